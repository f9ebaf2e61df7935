"""From a snapshot to the few numbers the rules use: the control temperature and the thresholds in force."""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import NamedTuple

from policies.schema import Thermal
from sensors.snapshot import Battery, Snapshot

PASSIVE_TRIPS = frozenset({"passive"})
ZoneReading = tuple[str, float, float | None, float | None]  # label, °C, its own lowest passive and critical trips
CRITICAL_TRIPS = frozenset({"critical", "crit"})


class ThermalView(NamedTuple):
    """The thermal picture of one tick, told from the binding zone: the trusted zone with the least headroom under
    its own passive trip (thermald and the kernel judge each zone against its own trips; a phone's 43 °C skin
    limit binds long before its CPU's 95 °C). Every threshold below is on that zone's own scale. (A NamedTuple, like
    `Sense`: immutable and built every tick at half a frozen dataclass's cost.)"""

    temp_c: float | None  # the binding zone's reading, None when no trusted zone reads
    zone: str | None
    trip_c: float  # the binding zone's trip
    trip_source: str  # "policy", "<zone> passive trip" or "fallback"
    hot_enter_c: float
    hot_exit_c: float
    setpoint_c: float
    critical_c: float  # critical threshold of the zone nearest its own (critical_zone)
    critical_exit_c: float
    # Trusted zones exist but none gave a plausible reading (unreadable, garbage, absurd, vanished): unlike a
    # device with no zone at all, this is a broken sensor, and the policy turns conservative after a grace.
    untrusted: bool = False
    # trip_c minus the reference trip (the policy's, else the lowest passive trip of the trusted zones): temp_c -
    # scale_offset_c is on one scale across zones, continuous when the binding zone changes (the forecast's scale).
    scale_offset_c: float = 0.0
    critical_temp_c: float | None = None  # the reading of the zone nearest its critical threshold
    critical_zone: str | None = None

    @property
    def headroom_c(self) -> float | None:
        """°C left under the binding zone's trip (negative: over it)."""
        return None if self.temp_c is None else self.trip_c - self.temp_c


class ZoneThresholds(NamedTuple):
    """One trusted zone's numbers as resolved on a device (`governor policy show --root`)."""

    zone: str
    temp_c: float
    trip_c: float
    trip_source: str
    hot_enter_c: float
    hot_exit_c: float
    setpoint_c: float
    critical_c: float


class Sense(NamedTuple):
    """One tick's readings and the raw critical causes, as the rules and the explanation see them."""

    view: ThermalView
    forecast_c: float | None
    busy: float  # engine busy fraction over the activity window
    battery: Battery | None
    on_power: bool
    available: int | None  # bytes
    psi: float | None
    pressure: bool  # memory pressure (PSI) condition, debounced
    crit_thermal: bool
    crit_battery: bool
    crit_memory: bool
    cpu_throttled: bool | None = None  # the kernel or firmware is already holding the clock down
    untrusted: bool = False  # no trustworthy temperature for longer than the grace: hot limits apply
    given_up: str | None = None  # the engine was given up (EngineObservation.given_up): critical, and why
    # Critical for the memory floor alone (no heat, no battery, no given-up engine); in critical's dwell, once its
    # causes cleared, what it was last for (policies/conditions.py)
    memory_only: bool = False


class ZoneFilter:
    """Which zones the policy trusts; matching is cached per label because it runs every tick."""

    def __init__(self, thermal: Thermal) -> None:
        self._patterns = tuple(p.lower() for p in thermal.zones)
        self._cache: dict[str, bool] = {}
        self._cfg = thermal

    def trusted(self, label: str) -> bool:
        hit = self._cache.get(label)
        if hit is None:
            low = label.lower()
            hit = self._cache[label] = any(fnmatchcase(low, p) for p in self._patterns)
        return hit

    def _zones(self, snapshot: Snapshot) -> tuple[list[ZoneReading], tuple[float, str] | None, float | None, bool]:
        """Plausible trusted readings with their own lowest trips; the lowest passive (with its zone) and critical
        trips among all trusted zones (a zone that does not read still declares its trips); any zone trusted."""
        cfg = self._cfg
        readings: list[ZoneReading] = []
        passive: tuple[float, str] | None = None
        critical: float | None = None
        trusted_zones = False
        for reading in snapshot.temperatures:
            if not self.trusted(reading.label):
                continue
            trusted_zones = True
            own_passive: float | None = None
            own_critical: float | None = None
            for declared in reading.trips:
                if declared.type in PASSIVE_TRIPS and (own_passive is None or declared.temp_c < own_passive):
                    own_passive = declared.temp_c
                elif declared.type in CRITICAL_TRIPS and (own_critical is None or declared.temp_c < own_critical):
                    own_critical = declared.temp_c
            if own_passive is not None and (passive is None or own_passive < passive[0]):
                passive = (own_passive, reading.label)
            if own_critical is not None and (critical is None or own_critical < critical):
                critical = own_critical
            value = reading.temp_c
            if value is not None and value < cfg.plausible_max_c:
                readings.append((reading.label, value, own_passive, own_critical))
        battery = snapshot.battery
        battery_c = battery.temp_c if cfg.use_battery_temp and battery is not None else None
        if battery_c is not None and battery_c < cfg.plausible_max_c:
            readings.append(("battery", battery_c, None, None))
        return readings, passive, critical, trusted_zones

    def _critical(self, reference: float, zone_trip: float, own_critical: float | None) -> float:
        """A zone's critical threshold: the policy's, else its own critical trip - margin (else the reference), and
        at most its passive trip + critical_over_trip_c where the policy says so."""
        cfg = self._cfg
        if cfg.critical_c is not None:
            return cfg.critical_c
        zone_crit = reference if own_critical is None else own_critical - cfg.critical_margin_c
        if cfg.critical_over_trip_c is not None:
            zone_crit = min(zone_crit, zone_trip + cfg.critical_over_trip_c)
        return zone_crit

    def thresholds(self, snapshot: Snapshot) -> list[ZoneThresholds]:
        """Every trusted zone's numbers as the policy resolves them on this device (`governor policy show --root`):
        the binding zone's view, computed for each zone alone against the same reference trip."""
        readings, passive, critical, _ = self._zones(snapshot)
        out = []
        for zone in readings:
            v = self._view_of([zone], passive, critical, None)
            out.append(
                ZoneThresholds(zone[0], zone[1], v.trip_c, v.trip_source, v.hot_enter_c, v.hot_exit_c, v.setpoint_c,
                               v.critical_c)
            )  # fmt: skip
        return out

    def view(self, snapshot: Snapshot, control_margin_c: float | None = None) -> ThermalView:
        """Each trusted zone against its own trips: a zone's passive trip is its own lowest one, else the reference
        trip (the policy's `trip_c`, else the lowest passive trip among trusted zones, else the fallback); an explicit
        `trip_c` / `critical_c` in the policy applies to every zone. The hot thresholds keep their distance to the trip
        on every zone, so the zone with the least headroom is the one nearest hot, the PI's setpoint and the trip.
        `control_margin_c`: the setpoint's distance under the binding zone's trip instead of the policy's
        `control_margin_c` (the power allocator's clock steps let it sit closer), still above the hot exit."""
        readings, passive, critical, trusted_zones = self._zones(snapshot)
        return self._view_of(readings, passive, critical, control_margin_c, trusted_zones=trusted_zones)

    def _view_of(
        self,
        readings: list[ZoneReading],
        passive: tuple[float, str] | None,
        critical: float | None,
        control_margin_c: float | None,
        *,
        trusted_zones: bool = True,
    ) -> ThermalView:
        cfg = self._cfg
        if cfg.trip_c is not None:
            trip, source = cfg.trip_c, "policy"
        elif passive is not None:
            trip, source = passive[0], f"{passive[1]} passive trip"
        else:
            trip, source = cfg.fallback_trip_c, "fallback"
        enter = cfg.hot_c if cfg.hot_c is not None else trip - cfg.hot_margin_c
        exit_c = enter - cfg.hysteresis_c
        # An explicit hot_c can sit above trip - control_margin: the setpoint must stay above the exit.
        setpoint = max(trip - cfg.control_margin_c, exit_c + 0.5)
        crit = self._critical(cfg.fallback_critical_c, trip, critical)

        temp: float | None = None
        zone: str | None = None
        offset, zone_source = 0.0, source
        crit_temp: float | None = None
        crit_zone: str | None = None
        crit_at = crit
        headroom = crit_headroom = math.inf
        for label, value, own_passive, own_critical in readings:
            own = own_passive is not None and cfg.trip_c is None
            zone_trip = own_passive if own_passive is not None and own else trip
            if zone_trip - value < headroom:  # ties: the first zone, as the hottest-zone rule had it
                headroom, temp, zone, offset = zone_trip - value, value, label, zone_trip - trip
                zone_source = f"{label} passive trip" if own else source
            zone_crit = self._critical(crit, zone_trip, own_critical)
            if zone_crit - value < crit_headroom:
                crit_headroom, crit_temp, crit_zone, crit_at = zone_crit - value, value, label, zone_crit
        zone_trip_c, zone_exit_c = trip + offset, exit_c + offset
        if control_margin_c is None:
            setpoint_c = setpoint + offset
        else:
            setpoint_c = max(zone_trip_c - control_margin_c, zone_exit_c + 0.5)
        return ThermalView(
            temp_c=temp,
            zone=zone,
            trip_c=zone_trip_c,
            trip_source=zone_source,
            hot_enter_c=enter + offset,
            hot_exit_c=zone_exit_c,
            setpoint_c=setpoint_c,
            critical_c=crit_at,
            critical_exit_c=crit_at - cfg.critical_hysteresis_c,
            untrusted=trusted_zones and temp is None,
            scale_offset_c=offset,
            critical_temp_c=crit_temp,
            critical_zone=crit_zone,
        )
