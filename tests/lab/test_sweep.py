"""The parameter sweep: overrides by dotted path, parallel runs, CSV, plot and the best by the documented score."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from governor.cli import main
from governor.lab.deciders import load_policy
from governor.lab.sweep import SweepError, override, parse_param


def test_override_by_dotted_path_validates() -> None:
    policy = load_policy("raspberry-pi")
    assert policy is not None
    changed = override(policy, {"thermal.hot_margin_c": 8.0, "states.hot.max_tokens_per_s": 3.0})
    assert changed.thermal.hot_margin_c == 8.0
    assert changed.states[next(s for s in changed.states if s.value == "hot")].max_tokens_per_s == 3.0
    with pytest.raises(SweepError, match="the policy has no field 'hot_margin'"):
        override(policy, {"thermal.hot_margin": 8.0})
    with pytest.raises(SweepError, match=r"thermal\.hot_margin_c"):
        override(policy, {"thermal.hot_margin_c": -1.0})


def test_param_values_are_toml_scalars() -> None:
    assert parse_param("thermal.hot_margin_c=3,5.5").values == (3, 5.5)
    assert parse_param("states.hot.kv_type=f16,q8_0").values == ("f16", "q8_0")
    with pytest.raises(SweepError, match="expected KEY=v1,v2"):
        parse_param("thermal.hot_margin_c")


def test_sweep_cli_writes_csv_and_plot_and_names_the_best(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r.csv", tmp_path / "s.png"
    args = ["sweep", "--device", "raspberry-pi-5", "--policy", "raspberry-pi", "--workload", "long-chat"]
    args += ["--param", "thermal.hot_margin_c=2,6", "--param", "states.hot.threads=2,3", "--minutes", "12"]
    assert main([*args, "--out", str(out), "--plot", str(png), "--jobs", "2"]) == 0
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert {(r["thermal.hot_margin_c"], r["states.hot.threads"]) for r in rows} == {
        ("2", "2"), ("2", "3"), ("6", "2"), ("6", "3")
    }  # fmt: skip
    top = max(float(r["score"]) for r in rows)
    assert top > 0
    best = [r for r in rows if float(r["score"]) == top]
    printed = capsys.readouterr().out
    keys = ("thermal.hot_margin_c", "states.hot.threads")
    named = ["best: " + ", ".join(f"{k}={r[k]}" for k in keys) for r in best]
    assert any(name in printed for name in named), (printed, best)
    for r in rows:
        assert (float(r["score"]) > 0) == (float(r["peak_c"]) < float(r["trip_c"]) and r["oom_kills"] == "0")
    assert png.stat().st_size > 10_000
