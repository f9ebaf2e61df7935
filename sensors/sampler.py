"""The facade the daemon and the lab call: `make_sampler(...)` picks the backends, `.sample()` returns a Snapshot.

File lists are discovered once and again when a listed file vanishes or every `rediscover_s`, so a sample reads
about one file per reading. Readings are built with full validation: bench/bench_sensors.py measures that at about a
quarter of a sample (0.08 of 0.35 ms), so `model_construct` would buy little and lose the check.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar, cast

import structlog

from sensors.cpu import CPU_DIR, CpuInventory, discover_cpus, read_cpu
from sensors.load import PROC_STAT, PSI_CPU, Load, LoadReader
from sensors.memory import LMKD, MEMINFO, PSI_MEMORY, read_memory
from sensors.power import Supply, discover_supplies, read_battery
from sensors.psutil_backend import PsutilSampler
from sensors.root import Reader, Root
from sensors.snapshot import Battery, Problem, Snapshot, Temperature
from sensors.termux import DEFAULT_COMMAND, TermuxBattery, termux_detected
from sensors.thermal import HWMON_DIR, THERMAL_DIR, Input, discover_hwmon, discover_zones, read_zone

T = TypeVar("T")


class Sampler(Protocol):
    def sample(self) -> Snapshot: ...

    def notes(self) -> list[str]: ...

    def warm_up(self) -> None: ...

    def invalidate(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Inventory:
    inputs: tuple[Input, ...]
    supplies: tuple[Supply, ...]
    cpus: CpuInventory
    meminfo: bool
    psi: bool
    stat: bool
    cpu_psi: bool
    denied: int
    at: float
    lmkd: bool = False  # Android's low memory killer is there (sensors.memory.LMKD)


@dataclass(frozen=True, slots=True)
class _Kept:
    key: tuple[object, ...]
    at: float
    value: object
    problems: list[Problem]


class StuckDetector:
    """A temperature that has not changed for `samples` samples while another one moved within that span is stuck.

    Real sensors jitter by at least one LSB under any load; a sensor frozen at one value (some read a constant
    >135 °C on healthy phones) is broken. When every sensor is still (an idle, cool box) nothing is flagged.
    """

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self._last: dict[str, float] = {}
        self._still: dict[str, int] = {}

    def update(self, readings: Mapping[str, float | None]) -> dict[str, int]:
        """Stuck sources and for how many samples each has not changed."""
        for source, value in readings.items():
            if value is None:
                continue
            if self._last.get(source) == value:
                self._still[source] += 1
            else:
                self._last[source] = value
                self._still[source] = 0
        stuck = {s: n for s, n in self._still.items() if n >= self.samples and s in readings}
        if stuck and any(n < self.samples for s, n in self._still.items() if s not in stuck and s in readings):
            return stuck
        return {}

    def forget_except(self, sources: set[str]) -> None:
        for source in set(self._last) - sources:
            del self._last[source], self._still[source]


class SensorSampler:
    """Linux sysfs/procfs under `root` (a path or a `Root`), with termux-battery-status when a command is given."""

    def __init__(
        self,
        root: Root | Path | str = "/",
        *,
        termux_cmd: Sequence[str] | None = None,
        termux_timeout_s: float = 3.0,
        termux_refresh_s: float = 5.0,
        cpu_util: Callable[[], float | None] | Literal["auto"] | None = "auto",
        engine_pid: Callable[[], int | None] | None = None,
        rediscover_s: float = 30.0,
        stuck_samples: int = 120,
        slow_max_age_s: float = 0.0,
        own_caps: Callable[[], Mapping[str, int]] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root if isinstance(root, Root) else Root(root)
        self.termux = (
            TermuxBattery(termux_cmd, timeout_s=termux_timeout_s, refresh_s=termux_refresh_s, monotonic=monotonic)
            if termux_cmd
            else None
        )
        # "auto": busy % from proc/stat under the root (the same deltas as other processes' CPU use).
        self._util = None if cpu_util == "auto" else cpu_util
        self._load = LoadReader(self.root)
        self.engine_pid = engine_pid  # whose CPU time is the engine's own, not "another process" (the daemon sets it)
        self.own_caps = own_caps  # the clock limits the governor itself wrote: not throttling (sensors/cpu.py)
        self.rediscover_s = rediscover_s
        # The slow readings, power supplies, memory and the CPU load, are read at most this often (0: every
        # sample): the fast (mitigating) tick is for the thermal controller, as thermald's fast poll reads only
        # temperatures. Fuel gauges update every few seconds; the kernel recomputes PSI's averages every 2 s
        # (kernel/sched/psi.c, PSI_FREQ); other processes' CPU use over a second is steadier than over a quarter
        # (the contention rule debounces a second) and proc/stat is a few KiB of text the kernel formats per read
        # on a phone; 1 s is the pace of an ordinary tick. At the 0.25 s tick the ~10 battery files were a quarter
        # of the daemon's tick and memory a tenth (issue 16).
        # A charger plugged or pulled is a uevent: supply_changed() (or a rediscovery) makes the next sample read
        # the supplies again.
        self.slow_max_age_s = slow_max_age_s
        self._kept: dict[str, _Kept] = {}
        self._supply_events = 0
        self._monotonic = monotonic
        self._stuck = StuckDetector(stuck_samples)
        self._inventory: Inventory | None = None
        self._pending: list[Problem] = []  # found by a discovery outside sample(): reported by the next sample
        # Every temperature input ever discovered: one that disappears (zone removed, `temp` deleted or replaced by
        # a directory) stays in the readings as unknown and in `problems` as vanished, instead of silently leaving.
        self._known: dict[str, Input] = {}
        self._temps: dict[str, tuple[Input, Temperature]] = {}  # each input's last reading (see _temperature)
        self._log = structlog.get_logger("sensors")

    def invalidate(self) -> None:
        """Rediscover before the next sample (a udev event said devices came or went)."""
        self._inventory = None

    def supply_changed(self) -> None:
        """A power_supply uevent (a charger pulled, a battery's status): read the supplies at the next sample. From
        any thread: a reading taken while the event arrived is not reused."""
        self._supply_events += 1

    def _slow(self, name: str, key: tuple[object, ...], now: float, reader: Reader, read: Callable[[], T]) -> T:
        """`read()`, or its last value (and the problems it reported) if younger than `slow_max_age_s` and taken
        under the same `key` (the inventory, the supply events)."""
        last = self._kept.get(name)
        if last is not None and last.key == key and now - last.at < self.slow_max_age_s:
            reader.problems.extend(last.problems)
            return cast(T, last.value)
        before = len(reader.problems)
        value = read()
        self._kept[name] = _Kept(key, now, value, reader.problems[before:])
        return value

    def _discover(self, reader: Reader, now: float) -> Inventory:
        self.root.release()  # files read every sample are opened again: none outlives a discovery period
        inputs = (*discover_zones(self.root, reader), *discover_hwmon(self.root, reader))
        self._stuck.forget_except({i.source for i in inputs})
        self._known.update((i.source, i) for i in inputs)
        return Inventory(
            inputs=inputs,
            supplies=tuple(discover_supplies(self.root, reader)),
            cpus=discover_cpus(self.root, reader),
            meminfo=self.root.exists(self.root.path(MEMINFO)),
            psi=self.root.exists(self.root.path(PSI_MEMORY)),
            lmkd=self.root.exists(self.root.path(LMKD)),
            stat=self.root.exists(self.root.path(PROC_STAT)),
            cpu_psi=self.root.exists(self.root.path(PSI_CPU)),
            denied=len(reader.denied),
            at=now,
        )

    def inventory(self) -> Inventory:
        if self._inventory is None:
            reader = Reader(self.root)
            self._inventory = self._discover(reader, self._monotonic())
            self._pending = reader.problems
        return self._inventory

    def sample(self) -> Snapshot:
        try:
            return self._sample()
        except Exception as exc:
            # Every known fault is handled where it happens; this is for the unknown one. The loop must keep its
            # tick (and restore the engine on exit), so a bug here costs one sample, reported, not the daemon.
            self._log.exception("sensor_sample_failed")
            self._inventory = None
            return Snapshot(problems=(Problem(path="sensors", reason=f"internal error: {exc!r}"),))

    def _sample(self) -> Snapshot:
        now = self._monotonic()
        reader = Reader(self.root)
        reader.problems, self._pending = self._pending, []
        inv = self._inventory
        if inv is None or now - inv.at >= self.rediscover_s:
            inv = self._inventory = self._discover(reader, now)
        with self.root.holding():
            return self._read(reader, inv, now)

    def _read(self, reader: Reader, inv: Inventory, now: float) -> Snapshot:
        values = {item.source: read_zone(reader, item) for item in inv.inputs}
        for source, still in self._stuck.update(values).items():
            item = next(i for i in inv.inputs if i.source == source)
            reader.problem(item.path, f"stuck: {values[source]:g} °C unchanged for {still} samples while others moved")
            values[source] = None
        temperatures = [self._temperature(i, values[i.source]) for i in inv.inputs]
        for gone in (i for source, i in self._known.items() if source not in values):
            if not any(p.path == self.root.display(gone.path) for p in reader.problems):
                reader.problem(gone.path, "vanished: no longer readable")
            temperatures.append(
                Temperature(source=gone.source, kind=gone.kind, label=gone.label, temp_c=None, trips=gone.trips)
            )
        key = (inv, self._supply_events)
        battery = self._slow("battery", key, now, reader, lambda: read_battery(reader, list(inv.supplies)))
        if self.termux is not None and (battery is None or battery.percent is None):
            from_termux, problems = self.termux.latest()
            reader.problems.extend(problems)
            battery = from_termux or battery
        if battery is not None and battery.temp_c is not None and all(t.temp_c is None for t in temperatures):
            temperatures.append(_battery_temperature(battery))
        load = self._slow("load", (inv,), now, reader, lambda: self._read_load(reader, inv))
        util = self._util() if self._util is not None else load.util_percent
        snapshot = Snapshot(
            temperatures=tuple(temperatures),
            battery=battery,
            memory=self._slow(
                "memory",
                (inv,),
                now,
                reader,
                lambda: read_memory(reader, self.root, meminfo=inv.meminfo, psi=inv.psi, lmkd=inv.lmkd),
            ),
            cpu=read_cpu(reader, inv.cpus, util, load, self.own_caps() if self.own_caps is not None else None),
            problems=tuple(reader.problems),
        )
        if reader.vanished:
            self._inventory = None
        return snapshot

    def _temperature(self, item: Input, temp_c: float | None) -> Temperature:
        """The reading as a `Temperature`, the last one's object while its value has not moved: a phone has dozens
        of zones, most of them steady from one 0.25 s tick to the next, and each object is ~9 µs to validate."""
        last = self._temps.get(item.source)
        if last is not None and last[0] is item and last[1].temp_c == temp_c:
            return last[1]
        reading = Temperature(source=item.source, kind=item.kind, label=item.label, temp_c=temp_c, trips=item.trips)
        self._temps[item.source] = (item, reading)
        return reading

    def _read_load(self, reader: Reader, inv: Inventory) -> Load:
        pid = self.engine_pid() if self.engine_pid is not None else None
        return self._load.read(reader, pid, stat=inv.stat, psi=inv.cpu_psi)

    def warm_up(self) -> None:
        """One-shot callers (the CLI) wait for termux-battery-status's first answer; the loop never does."""
        if self.termux is not None and not any(s.battery for s in self.inventory().supplies):
            self.termux.wait_first(self.termux.timeout_s + 1)

    def notes(self) -> list[str]:
        """What was found and what not, in words (the CLI prints these above the table)."""
        inv, shown = self.inventory(), self.root.shown
        kinds = [i.kind for i in inv.inputs]
        notes = [
            f"{kinds.count('thermal_zone')} thermal zones under {shown(THERMAL_DIR)}"
            if "thermal_zone" in kinds
            else f"no thermal zones under {shown(THERMAL_DIR)}",
        ]
        if "hwmon" in kinds:
            notes.append(f"{kinds.count('hwmon')} hwmon temperatures under {shown(HWMON_DIR)}")
        elif self.root.exists(self.root.path(HWMON_DIR)):
            notes.append(f"no hwmon temperatures under {shown(HWMON_DIR)}")
        else:
            notes.append(f"no hwmon ({shown(HWMON_DIR)} is absent)")
        if inv.denied:
            notes.append(f"{inv.denied} files not permitted to read (SELinux?): left out")
        batteries = [s.name for s in inv.supplies if s.battery]
        others = [s.name for s in inv.supplies if not s.battery]
        if batteries:
            notes.append(
                f"battery: {', '.join(batteries)}" + (f"; external power: {', '.join(others)}" if others else "")
            )
        elif self.termux is not None:
            notes.append(f"no sysfs battery; asking {' '.join(self.termux.command)} in the background")
        elif others:
            notes.append(f"no battery (power_supply has only {', '.join(others)})")
        else:
            notes.append("no battery (no power_supply devices)")
        if inv.cpus.cores:
            cpus, policies = sum(len(c.numbers) for c in inv.cpus.cores), len(inv.cpus.cores)
            notes.append(f"cpufreq for {cpus} CPUs ({policies} polic{'y' if policies == 1 else 'ies'})")
        else:
            notes.append(f"no CPU frequency (no cpufreq under {shown(CPU_DIR)})")
        if not inv.meminfo:
            notes.append(f"no memory figures ({shown(MEMINFO)} is absent)")
        if not inv.psi:
            notes.append(f"no memory pressure ({shown(PSI_MEMORY)} is absent)")
        if not inv.stat:
            notes.append(f"no CPU load figures ({shown(PROC_STAT)} is absent)")
        if not inv.cpu_psi:
            notes.append(f"no CPU pressure ({shown(PSI_CPU)} is absent)")
        return notes

    def close(self) -> None:
        self.root.release()
        if self.termux is not None:
            self.termux.close()

    def __enter__(self) -> SensorSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _battery_temperature(battery: Battery) -> Temperature:
    """The thermal signal of last resort: phones whose zones SELinux hides still report the battery's."""
    return Temperature(source=battery.source, kind="battery", label="battery", temp_c=battery.temp_c)


def make_sampler(
    root: Path | str = "/",
    *,
    termux_cmd: Sequence[str] | None = None,
    termux_timeout_s: float = 3.0,
    environ: Mapping[str, str] = os.environ,
    engine_pid: Callable[[], int | None] | None = None,
    slow_max_age_s: float = 0.0,
    own_caps: Callable[[], Mapping[str, int]] | None = None,
) -> Sampler:
    """sysfs when the tree is there (any Linux, or a fake tree under `root`); psutil otherwise (macOS, Windows).

    Under Termux (TERMUX_VERSION set, or PREFIX inside com.termux) termux-battery-status is used when sysfs shows
    no readable battery, unless another command is given.
    """
    prefix = Root(root)
    if prefix.is_live() and not os.path.isdir("/sys/class"):
        return PsutilSampler()
    if termux_cmd is None and termux_detected(environ):
        termux_cmd = DEFAULT_COMMAND
    return SensorSampler(
        prefix,
        termux_cmd=termux_cmd,
        termux_timeout_s=termux_timeout_s,
        engine_pid=engine_pid,
        slow_max_age_s=slow_max_age_s,
        own_caps=own_caps,
    )
