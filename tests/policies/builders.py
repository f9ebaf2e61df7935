"""Readings built directly from the sensor types, as the daemon would hand them to the policy core."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from policies.decision import Decision, Hold
from policies.machine import StateMachine
from sensors.snapshot import Battery, EngineObservation, Memory, Snapshot, Temperature, TraceRecord, Trip

MIB = 1024 * 1024


def snap(
    temp_c: float | None = 50.0,
    *,
    label: str = "cpu-thermal",
    trips: Sequence[tuple[str, float]] = (),
    extra: Sequence[Temperature] = (),
    percent: float | None = None,
    plugged: bool | None = None,
    charging: bool | None = None,
    battery_temp_c: float | None = None,
    available_mb: float | None = 4096.0,
    psi: float | None = None,
) -> Snapshot:
    zone = Temperature(
        source="thermal_zone0",
        kind="thermal_zone",
        label=label,
        temp_c=temp_c,
        trips=tuple(Trip(type=k, temp_c=v) for k, v in trips),
    )
    battery = None
    if percent is not None or plugged is not None or battery_temp_c is not None:
        battery = Battery(
            percent=percent, charging=charging, plugged=plugged, power_w=None, temp_c=battery_temp_c, source="simulated"
        )
    memory = Memory(
        total_bytes=8192 * MIB,
        available_bytes=None if available_mb is None else int(available_mb * MIB),
        psi_some_avg10=psi,
    )
    return Snapshot(temperatures=(zone, *extra), battery=battery, memory=memory)


BUSY = EngineObservation(busy=True, tokens_per_s=10.0)
IDLE = EngineObservation(busy=False)


def run(
    gov: StateMachine,
    snapshots: Iterable[Snapshot],
    *,
    dt: float = 1.0,
    t0: float = 0.0,
    engine: EngineObservation | None = BUSY,
    holds: Sequence[Hold] = (),
) -> list[Decision]:
    return [gov.decide(s, engine, t0 + i * dt, holds) for i, s in enumerate(snapshots)]


def states(decisions: Iterable[Decision]) -> list[str]:
    return [d.state.value for d in decisions]


def write_trace(path: Path, records: Iterable[tuple[float, Snapshot, EngineObservation | None]]) -> Path:
    with path.open("w") as out:
        for t, s, engine in records:
            record = TraceRecord(t=t, engine=engine, **s.model_dump())
            out.write(json.dumps(record.model_dump(mode="json")) + "\n")
    return path
