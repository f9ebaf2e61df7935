"""From a snapshot to the few numbers the rules use: the control temperature and the thresholds in force."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from policies.schema import Thermal
from sensors.snapshot import Battery, Snapshot

PASSIVE_TRIPS = frozenset({"passive"})
CRITICAL_TRIPS = frozenset({"critical", "crit"})


@dataclass(frozen=True, slots=True)
class ThermalView:
    temp_c: float | None  # the hottest trusted zone, None when no trusted zone reads
    zone: str | None
    trip_c: float
    trip_source: str  # "policy", "<zone> passive trip" or "fallback"
    hot_enter_c: float
    hot_exit_c: float
    setpoint_c: float
    critical_c: float
    critical_exit_c: float
    # Trusted zones exist but none gave a plausible reading (unreadable, garbage, absurd, vanished): unlike a
    # device with no zone at all, this is a broken sensor, and the policy turns conservative after a grace.
    untrusted: bool = False


@dataclass(frozen=True, slots=True)
class Sense:
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

    def view(self, snapshot: Snapshot) -> ThermalView:
        cfg = self._cfg
        temp: float | None = None
        zone: str | None = None
        passive: tuple[float, str] | None = None
        critical: float | None = None
        trusted_zones = False
        for reading in snapshot.temperatures:
            if not self.trusted(reading.label):
                continue
            trusted_zones = True
            value = reading.temp_c
            if value is not None and value < cfg.plausible_max_c and (temp is None or value > temp):
                temp, zone = value, reading.label
            for declared in reading.trips:
                if declared.type in PASSIVE_TRIPS and (passive is None or declared.temp_c < passive[0]):
                    passive = (declared.temp_c, reading.label)
                elif declared.type in CRITICAL_TRIPS and (critical is None or declared.temp_c < critical):
                    critical = declared.temp_c
        battery = snapshot.battery
        battery_c = battery.temp_c if cfg.use_battery_temp and battery is not None else None
        if battery_c is not None and battery_c < cfg.plausible_max_c and (temp is None or battery_c > temp):
            temp, zone = battery_c, "battery"

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
        if cfg.critical_c is not None:
            crit = cfg.critical_c
        elif critical is not None:
            crit = critical - cfg.critical_margin_c
        else:
            crit = cfg.fallback_critical_c
        return ThermalView(
            temp_c=temp,
            zone=zone,
            trip_c=trip,
            trip_source=source,
            hot_enter_c=enter,
            hot_exit_c=exit_c,
            setpoint_c=setpoint,
            critical_c=crit,
            critical_exit_c=crit - cfg.critical_hysteresis_c,
            untrusted=trusted_zones and temp is None,
        )
