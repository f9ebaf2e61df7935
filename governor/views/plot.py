"""`governor plot TRACE.jsonl [--compare OTHER.jsonl]`: a recorded trace drawn as the lab draws a simulated run.

A trace (`governor record`, or `governor lab --trace`) holds readings and the engine's observations, not the daemon's
decisions: the policy is replayed over it (the same `decide()` as `governor replay`), which gives the binding zone's
temperature and trip, as the lab's "limiting zone", and the state band. Give `--policy` the policy the device ran.
"""

from __future__ import annotations

import math
from pathlib import Path

from govbase.errors import GovernorError
from governor.lab.report import PlotLine, draw
from policies.assemble import build_state_machine
from policies.replay import read_trace


def trace_line(path: Path, policy: str) -> tuple[PlotLine, float | None, str | None]:
    """The trace as a plot line, with the binding zone's trip and name (from its last reading that had them)."""
    machine = build_state_machine(policy)
    t_s: list[float] = []
    temp_c: list[float] = []
    tokens: list[float] = []
    states: list[tuple[float, str]] = []
    trip: float | None = None
    zone: str | None = None
    try:
        stream = path.open(encoding="utf-8")
    except OSError as exc:
        raise GovernorError(f"{path}: cannot read trace: {exc.strerror}") from exc
    with stream:
        t0: float | None = None
        for record in read_trace(stream, path):
            decision = machine.decide(record, record.engine, record.t)
            t0 = record.t if t0 is None else t0
            t = record.t - t0
            readings = decision.readings
            temp = readings.get("temp_c")
            t_s.append(t)
            temp_c.append(float(temp) if isinstance(temp, int | float) else math.nan)
            trip_c, zone_name = readings.get("trip_c"), readings.get("zone")
            if isinstance(trip_c, int | float) and zone_name:
                trip, zone = float(trip_c), str(zone_name)
            engine = record.engine
            tokens.append((engine.tokens_per_s or 0.0) if engine is not None else 0.0)
            if not states or states[-1][1] != decision.state.value:
                states.append((t, decision.state.value))
    if not t_s:
        raise GovernorError(f"{path}: the trace has no records")
    return PlotLine(path.stem, t_s, temp_c, tokens, states, t_s[-1]), trip, zone


def plot_traces(paths: list[Path], out: Path, *, policy: str = "default") -> None:
    lines = [trace_line(p, policy) for p in paths]
    _, trip, zone = lines[0]
    title = " vs ".join(line.label for line, _, _ in lines) + f" (policy {Path(policy).stem})"
    draw([line for line, _, _ in lines], out, title=title, trip_c=trip, zone=zone or "zone")
