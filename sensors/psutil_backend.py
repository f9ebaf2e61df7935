"""psutil for what it does well: one process's RSS and CPU, whole-machine CPU utilisation, and the fallback
backend where the Linux sysfs trees are absent (a macOS or Windows development machine)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from sensors.root import MAX_SANE_C, MIN_SANE_C
from sensors.snapshot import Battery, Cpu, Memory, Problem, Snapshot, Temperature, Trip


@dataclass(frozen=True, slots=True)
class ProcessReading:
    rss_bytes: int | None
    cpu_percent: float | None  # of one core, as top shows it: 200 = two cores busy


class ProcessStats:
    """The engine process's footprint. A process that is gone reads as unknown, not as an error."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._proc: psutil.Process | None = psutil.Process(pid)
            self._proc.cpu_percent(None)  # psutil's first call has no interval to measure over: prime it
        except psutil.Error:
            self._proc = None

    def sample(self) -> ProcessReading:
        if self._proc is None:
            return ProcessReading(None, None)
        try:
            with self._proc.oneshot():
                return ProcessReading(self._proc.memory_info().rss, self._proc.cpu_percent(None))
        except psutil.Error:
            return ProcessReading(None, None)


class CpuUtilisation:
    """Whole-machine CPU busy % since the previous figure, from psutil.cpu_times() deltas.

    Not psutil.cpu_percent(None): its baseline is one module-wide value shared with every other caller in the
    process (the daemon's metrics, the engine), which would shorten each other's intervals. Over less than
    `min_interval_s` the figure is noise (a one-shot CLI would report its own start-up), so until then the previous
    figure stands, or None before the first one.
    """

    def __init__(self, min_interval_s: float = 0.5, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.min_interval_s = min_interval_s
        self._monotonic = monotonic
        self._since = monotonic()
        self._base = _busy_total()
        self._last: float | None = None

    def __call__(self) -> float | None:
        now = self._monotonic()
        if now - self._since >= self.min_interval_s:
            busy, total = _busy_total()
            d_busy, d_total = busy - self._base[0], total - self._base[1]
            if d_total > 0:
                self._last = round(min(100.0, max(0.0, 100 * d_busy / d_total)), 1)
            self._base, self._since = (busy, total), now
        return self._last


def _busy_total() -> tuple[float, float]:
    times = psutil.cpu_times()
    # Linux counts guest time inside user time already; idle and iowait are both "not busy" (as psutil does).
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    idle = times.idle + getattr(times, "iowait", 0.0)
    return total - idle, total


class PsutilSampler:
    """The fallback backend. `api` is the psutil module; a test passes a small fake with the same functions."""

    def __init__(self, api: Any = psutil) -> None:
        self._api = api
        self._util = CpuUtilisation() if api is psutil else None

    def sample(self) -> Snapshot:
        problems: list[Problem] = []
        return Snapshot(
            temperatures=self._temperatures(problems),
            battery=self._battery(),
            memory=self._memory(),
            cpu=self._cpu(),
            problems=tuple(problems),
        )

    def close(self) -> None:
        """Nothing to release; present so every backend closes the same way."""

    def notes(self) -> list[str]:
        return ["using psutil (no Linux sysfs tree here)"]

    def warm_up(self) -> None:
        """Nothing runs in the background here."""

    def invalidate(self) -> None:
        """psutil rediscovers on every call."""

    def _temperatures(self, problems: list[Problem]) -> tuple[Temperature, ...]:
        read = getattr(self._api, "sensors_temperatures", None)  # absent on macOS and Windows builds
        if read is None:
            return ()
        out: list[Temperature] = []
        for chip, entries in sorted(read().items()):
            for number, entry in enumerate(entries):
                source = f"psutil:{chip}/{number}"
                temp: float | None = entry.current
                if temp is not None and not MIN_SANE_C <= temp <= MAX_SANE_C:
                    problems.append(Problem(path=source, reason=f"absurd: {temp:g} °C"))
                    temp = None
                trips = tuple(
                    Trip(type=kind, temp_c=value)
                    for kind, value in (("max", entry.high), ("crit", entry.critical))
                    if value is not None and MIN_SANE_C <= value <= MAX_SANE_C
                )
                label = f"{chip}/{entry.label}" if entry.label else chip
                out.append(Temperature(source=source, kind="psutil", label=label, temp_c=temp, trips=trips))
        return tuple(out)

    def _battery(self) -> Battery | None:
        read = getattr(self._api, "sensors_battery", None)
        status = read() if read is not None else None
        if status is None:
            return None
        plugged = status.power_plugged
        return Battery(
            percent=status.percent,
            charging=None if plugged is None else bool(plugged and status.percent < 100),
            plugged=plugged,
            power_w=None,
            temp_c=None,
            source="psutil",
        )

    def _memory(self) -> Memory:
        virtual, swap = self._api.virtual_memory(), self._api.swap_memory()
        return Memory(
            total_bytes=virtual.total,
            available_bytes=virtual.available,
            swap_total_bytes=swap.total,
            swap_free_bytes=swap.free,
        )

    def _cpu(self) -> Cpu:
        freq = self._api.cpu_freq()
        ratio = min(freq.current / freq.max, 1.0) if freq is not None and freq.max else None
        return Cpu(
            freq_ratio=ratio,
            throttled=None,  # psutil cannot tell a capped clock from an idle one
            count=self._api.cpu_count(),
            util_percent=self._util() if self._util is not None else None,
        )
