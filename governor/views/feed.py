"""What `governor top` keeps of the daemon's `watch` stream: the latest status, short histories, the decisions.

One sample per stream line (a tick, at most one a second); every series is aligned on the samples, None where a
reading was missing, so a chart's columns line up across series.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from policies.readings import CRITICAL_TRIPS, PASSIVE_TRIPS

KEEP = 400  # samples kept per series: the widest chart drawn
KEEP_DECISIONS = 60


@dataclass(frozen=True)
class Zone:
    """A temperature sensor with a trip: the kernel throttles at its passive trip (hwmon: `max`)."""

    source: str
    label: str
    trip_c: float | None
    critical_c: float | None


def zone_of(reading: dict[str, Any]) -> Zone:
    trips = reading.get("trips") or []
    passive = [t["temp_c"] for t in trips if t["type"] in PASSIVE_TRIPS or t["type"] == "max"]
    critical = [t["temp_c"] for t in trips if t["type"] in CRITICAL_TRIPS]
    return Zone(
        source=str(reading["source"]),
        label=str(reading.get("label") or reading["source"]),
        trip_c=min(passive) if passive else None,
        critical_c=min(critical) if critical else None,
    )


class Feed:
    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self.status: dict[str, Any] = {}
        self.wall: float | None = None  # the daemon's wall clock at the latest line
        self.samples = 0
        self.zones: dict[str, Zone] = {}  # by source, in the order first seen
        self.temps: dict[str, deque[float | None]] = {}
        self.forecast: deque[float | None] = deque(maxlen=keep)
        self.tokens: deque[float | None] = deque(maxlen=keep)
        self.states: deque[str | None] = deque(maxlen=keep)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=KEEP_DECISIONS)
        self.routes: list[dict[str, Any]] = []

    def start(self, first: dict[str, Any]) -> None:
        """The stream's first answer (a reconnect starts a new one: the histories go on, decisions are replaced)."""
        self.decisions.clear()
        self.routes = list(first.get("routes") or [])
        self.add(first)

    def add(self, line: dict[str, Any]) -> None:
        status = line.get("status") or {}
        self.status = status
        self.wall = line.get("wall")
        self.decisions.extend(line.get("decisions") or [])
        readings = status.get("readings") or {}
        seen: dict[str, float | None] = {}
        for reading in readings.get("temperatures") or []:
            zone = zone_of(reading)
            if zone.trip_c is None:
                continue  # a sensor nothing throttles on (a battery's, a board's): the status table shows it
            self.zones[zone.source] = zone
            seen[zone.source] = reading.get("temp_c")
        for source in self.zones:
            series = self.temps.setdefault(source, deque([None] * min(self.samples, self.keep), maxlen=self.keep))
            series.append(seen.get(source))
        basis = status.get("basis") or {}
        self.forecast.append(basis.get("forecast_c"))
        engine = status.get("engine") or {}
        self.tokens.append(engine.get("tokens_per_s"))
        self.states.append(status.get("state"))
        self.samples += 1

    def binding(self) -> Zone | None:
        """The zone the policy judges by (the decision's basis), else the one nearest its trip."""
        label = (self.status.get("basis") or {}).get("zone")
        by_label = [z for z in self.zones.values() if z.label == label]
        if by_label:
            return by_label[0]
        latest = {s: series[-1] for s, series in self.temps.items() if series and series[-1] is not None}
        candidates = [z for z in self.zones.values() if z.source in latest and z.trip_c is not None]
        if not candidates:
            return next(iter(self.zones.values()), None)
        return min(candidates, key=lambda z: (z.trip_c or 0.0) - (latest[z.source] or 0.0))
