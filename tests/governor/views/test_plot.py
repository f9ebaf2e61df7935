"""`governor plot`: a recorded trace drawn as the lab draws a run; a simulated run's trace gives the lab's own band."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from governor.lab.catalog import load_device
from governor.lab.deciders import decider_for, load_run
from governor.lab.experiment import simulate
from governor.lab.workload import load_workload
from governor.views.plot import trace_line
from tests.governor.daemon.daemon_proc import DaemonProc
from tests.governor.views.conftest import ZONE_TEMP
from tests.helpers import eventually

PNG = b"\x89PNG\r\n\x1a\n"


def governor(*args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "governor", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG), f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[float, str]], float, str]:
    """A lab run's trace, with the lab's own state changes, trip and limiting zone."""
    path = tmp_path_factory.mktemp("sim") / "sim.jsonl"
    device = load_device("pi4-closed-case")
    decider, workload = decider_for(load_run("raspberry-pi"), device), load_workload("long-chat")
    with path.open("w") as trace:
        run = simulate(device, decider, workload, policy_name="raspberry-pi", minutes=10, trace=trace)
    return path, run.states, run.summary.trip_c, run.summary.limit_zone


def test_a_simulated_runs_trace_replays_to_the_labs_own_state_band(
    simulated: tuple[Path, list[tuple[float, str]], float, str],
) -> None:
    path, lab_states, lab_trip, lab_zone = simulated
    line, trip, zone = trace_line(path, "raspberry-pi")
    assert [s for _, s in line.states] == [s for _, s in lab_states]
    assert [s for _, s in lab_states].count("hot") >= 2, "the run goes hot and back: a band worth comparing"
    first_t = lab_states[0][0]
    assert [round(t, 1) for t, _ in line.states] == [round(t - first_t, 1) for t, _ in lab_states]
    assert (trip, zone) == (lab_trip, lab_zone)


@pytest.mark.slow
def test_plot_draws_a_recorded_trace_beside_a_simulated_one(
    live: DaemonProc, tmp_path: Path, simulated: tuple[Path, list[tuple[float, str]], float, str]
) -> None:
    recorded = tmp_path / "device.jsonl"
    recorder = threading.Thread(
        target=governor, args=("record", recorded, "--seconds", "6", "--control-socket", live.control)
    )
    recorder.start()
    eventually(lambda: recorded.exists() and recorded.stat().st_size > 0)
    live.tree.write(ZONE_TEMP, 90000)  # the trace goes hot on the way
    recorder.join(30)
    line, trip, zone = trace_line(recorded, str(live.policy))
    assert (trip, zone) == (80.0, "cpu-thermal")
    assert line.temp_c[0] == 45.0
    assert line.temp_c[-1] == 90.0
    assert [s for _, s in line.states][-1] == "hot"

    out = tmp_path / "both.png"
    done = governor("plot", recorded, "--compare", simulated[0], "--policy", live.policy, "-o", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {out}"
    assert png_size(out) == (720, 560), "the lab's figure: 9 x 7 in at 80 dpi"


def test_a_bad_trace_is_one_line_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0.0}\n{"t": "soon"}\n')
    done = governor("plot", bad)
    assert done.returncode == 2
    assert done.stderr.startswith(f"governor: error: {bad}:2: t: ")
    assert len(done.stderr.splitlines()) == 1
    assert not bad.with_suffix(".png").exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    done = governor("plot", empty)
    assert done.stderr == f"governor: error: {empty}: the trace has no records\n"
