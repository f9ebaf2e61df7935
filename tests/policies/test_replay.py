"""`governor replay` on hand-written traces: a heat ramp, a cool-down, a charger pulled and plugged back,
memory pressure, and a broken line."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from governor.cli import main
from policies.decision import EngineConfig
from sensors.snapshot import EngineObservation, Snapshot
from tests.policies.builders import BUSY, IDLE, snap, write_trace

Line = dict[str, Any]


def replay_json(capsys: pytest.CaptureFixture[str], trace: Path, policy: str) -> list[Line]:
    assert main(["replay", str(trace), "--policy", policy, "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for line in lines:
        assert set(line) >= {"t", "state", "engine", "reason"}
        assert set(line["engine"]) == set(EngineConfig.model_fields)
    return lines


def trace_of(path: Path, snapshots: list[Snapshot], engine: EngineObservation | None = BUSY) -> Path:
    return write_trace(path, [(float(i), s, engine) for i, s in enumerate(snapshots)])


def pi_zone(temp: float) -> Snapshot:
    return snap(temp, label="cpu-thermal", trips=[("critical", 110.0)])


def test_heat_ramp_on_a_pi(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    temps = [55.0 + 0.25 * i for i in range(130)]  # 55 -> 87 °C over 130 s
    lines = replay_json(capsys, trace_of(tmp_path / "ramp.jsonl", [pi_zone(x) for x in temps]), "raspberry-pi")
    assert len(lines) == len(temps)
    order = [line["state"] for line in lines]
    first_hot = order.index("hot")
    assert "sustained" in order[:first_hot]
    assert temps[first_hot] < 75.0  # the forecast acted before the reading crossed hot at 75 °C
    assert lines[first_hot]["rule"] == "thermal.forecast_enter"
    assert "forecast" in lines[first_hot]["reason"]
    hot_threads = [line["engine"]["threads"] for line in lines[first_hot:]]
    assert hot_threads == sorted(hot_threads, reverse=True)  # heating only ever takes threads away
    first_critical = order.index("critical")
    assert temps[first_critical] >= 83.0
    assert lines[first_critical]["rule"] == "thermal.critical"
    assert lines[-1]["engine"]["threads"] == 1
    assert lines[-1]["engine"]["kv_type"] == "q4_0"
    assert order[first_critical:] == ["critical"] * (len(order) - first_critical)


def test_cool_down_comes_back_slowly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    temps = [81.0] * 40 + [81.0 - 0.5 * i for i in range(40)] + [60.0] * 120
    lines = replay_json(capsys, trace_of(tmp_path / "cool.jsonl", [pi_zone(x) for x in temps]), "raspberry-pi")
    order = [line["state"] for line in lines]
    left = next(i for i, s in enumerate(order) if i > 0 and order[i - 1] == "hot" and s != "hot")
    assert temps[left] < 70.0  # hot's exit, 5 °C below its entry
    assert lines[left]["rule"] == "thermal.exit"
    threads = [line["engine"]["threads"] for line in lines[left:]]
    rises = [i for i in range(1, len(threads)) if threads[i] > threads[i - 1]]
    assert all(threads[i] == threads[i - 1] + 1 for i in rises)  # one step at a time
    assert all(b - a >= 15 for a, b in itertools.pairwise(rises))  # recover_step_s of the Pi profile
    assert threads[-1] == 4
    assert lines[-1]["engine"]["max_tokens_per_s"] is None
    assert "hot" not in order[left:]


def test_charger_pulled_at_25_percent_and_plugged_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snaps = [snap(50.0, percent=25.0, plugged=True, charging=False)] * 10  # full-ish, on the charger
    snaps += [snap(50.0, percent=25.0 - 0.1 * i, plugged=False, charging=False) for i in range(120)]  # pulled
    snaps += [snap(50.0, percent=13.0, plugged=True, charging=True)] * 80  # plugged back
    lines = replay_json(capsys, trace_of(tmp_path / "charger.jsonl", snaps, IDLE), "default")
    order = [line["state"] for line in lines]
    low = order.index("low_battery")
    assert lines[low]["rule"] == "battery.low"
    assert 25.0 - 0.1 * (low - 10) <= 20.0  # only once at or below the 20 % threshold
    assert "on battery power" in lines[low]["reason"]
    assert lines[low]["engine"]["threads"] == 2
    back = next(i for i in range(130, len(order)) if order[i] != "low_battery")
    assert lines[back]["rule"] == "battery.plugged"
    assert 5 <= back - 130 <= 25  # after the exit debounce and dwell, not before
    assert lines[-1]["engine"]["threads"] == 4  # back up, one step per recover_step_s (and per changes.live_dwell_s)


def test_memory_pressure_shrinks_before_the_oom_killer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    psi = [0.0] * 10 + [float(min(40, 3 * i)) for i in range(30)] + [0.0] * 60
    snaps = [snap(50.0, psi=p, available_mb=2000.0) for p in psi]
    lines = replay_json(capsys, trace_of(tmp_path / "psi.jsonl", snaps, IDLE), "default")
    ctx = [line["engine"]["n_ctx"] for line in lines]
    first = next(i for i, line in enumerate(lines) if line["rule"] == "memory.pressure")
    assert psi[first] >= 10.0
    assert ctx[first] < ctx[first - 1]
    assert min(ctx) == 512
    assert "memory pressure" in lines[first]["reason"]
    assert ctx[-1] == 4096  # released after the pressure's exit debounce


def test_text_output_is_one_line_per_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = trace_of(tmp_path / "t.jsonl", [snap(50.0)] * 3)
    assert main(["replay", str(trace)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3
    assert "threads=4" in out[0]
    assert "idle" in out[0]


def test_a_bad_trace_line_names_its_number(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = trace_of(tmp_path / "bad.jsonl", [snap(50.0)] * 2)
    with trace.open("a") as out:
        out.write('{"t": 3.0, "temperatures": "hot"}\n')
    assert main(["replay", str(trace), "--json"]) == 2
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2  # the good lines were replayed
    assert captured.err.strip().startswith(f"governor: error: {trace}:3: temperatures:")
    assert len(captured.err.strip().splitlines()) == 1


def test_not_json_and_time_going_backwards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = trace_of(tmp_path / "x.jsonl", [snap(50.0)] * 2)
    with trace.open("a") as out:
        out.write("\n{oops\n")
    assert main(["replay", str(trace)]) == 2
    assert f"{trace}:4: " in capsys.readouterr().err
    back = write_trace(tmp_path / "back.jsonl", [(5.0, snap(), None), (4.0, snap(), None)])
    assert main(["replay", str(back)]) == 2
    assert "t goes backwards" in capsys.readouterr().err


def test_missing_trace_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_replay_with_a_model_ladder_fits_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.policies.test_memfit import write_gguf

    write_gguf(tmp_path / "big.gguf", layers=8, embd=512, heads=8, kv_heads=8, padding_bytes=60 * 1024 * 1024)
    write_gguf(tmp_path / "small.gguf", layers=4, embd=256, heads=8, kv_heads=4, padding_bytes=1024 * 1024)
    ladder = tmp_path / "ladder.toml"
    ladder.write_text(
        '[[tier]]\nname = "big"\npath = "big.gguf"\nn_ctx = 4096\n\n[[tier]]\nname = "small"\npath = "small.gguf"\n'
    )
    snaps = [snap(50.0, available_mb=2000.0)] * 3 + [snap(50.0, available_mb=150.0 + 300.0)] * 3
    trace = trace_of(tmp_path / "mem.jsonl", snaps, IDLE)
    assert main(["replay", str(trace), "--policy", "default", "--models", str(ladder), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["engine"]["model"] == "big"
    assert lines[0]["engine"]["n_ctx"] == 4096
    assert lines[-1]["engine"]["n_ctx"] < 4096 or lines[-1]["engine"]["model"] == "small"
    # within the model dwell of the first load the big model may keep its smallest setting on the reserve
    assert "bound by memory" in lines[-1]["reason"] or "bound by below its footprint" in lines[-1]["reason"]


def test_replay_reads_stdin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    trace = trace_of(tmp_path / "t.jsonl", [snap(50.0)] * 2)
    monkeypatch.setattr("sys.stdin", io.StringIO(trace.read_text()))
    assert main(["replay", "-", "--json"]) == 0
    assert [json.loads(line)["t"] for line in capsys.readouterr().out.splitlines()] == [0.0, 1.0]
