"""`governor simulate` as a user runs it: summary, JSON, comparison table, plot, trace and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from governor.cli import main


def test_summary_names_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--device", "raspberry-pi-5", "--policy", "none", "--minutes", "10"]) == 0
    out = capsys.readouterr().out
    for words in ("tokens generated", "mean", "p10", "time to first token", "peak", "kernel throttling",
                  "state changes", "J/token", "OOM kills", "battery used"):  # fmt: skip
        assert words in out


def test_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--device", "phone", "--policy", "android-termux", "--workload", "burst", "--json"]
    assert main([*args, "--minutes", "6"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["policy"] == "android-termux"
    assert summary["minutes"] == pytest.approx(6.0, abs=0.05)
    assert summary["tokens"] > 0
    assert summary["battery_used_pct"] > 0
    assert summary["limit_zone"] == "skin-therm"


def test_compare_adds_none_prints_one_table_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "cmp.png"
    args = ["simulate", "--device", "raspberry-pi-5", "--policy", "raspberry-pi", "--compare", "default"]
    assert main([*args, "--minutes", "8", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["raspberry-pi", "default", "none"]
    assert "1.00x" in rows[2]
    assert png.read_bytes().startswith(b"\x89PNG")
    assert png.stat().st_size < 200_000


def test_compare_json_is_a_list(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--device", "fanless-laptop", "--policy", "none", "--compare", "default", "--json"]
    assert main([*args, "--minutes", "3"]) == 0
    assert [s["policy"] for s in json.loads(capsys.readouterr().out)] == ["none", "default"]


def test_trace_is_written(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    args = ["simulate", "--device", "raspberry-pi-5", "--policy", "none", "--minutes", "2", "--trace", str(trace)]
    assert main(args) == 0
    assert len(trace.read_text().splitlines()) >= 100


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "toaster", "--policy", "none"], "toaster: no such device; shipped: "),
        (["--device", "phone", "--policy", "nope"], "nope: no such policy file or profile"),
        (["--device", "phone", "--policy", "none", "--workload", "marathon"], "marathon: no such workload"),
    ],
)
def test_bad_names_are_one_line_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err
