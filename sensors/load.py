"""CPU contention: who else uses the CPUs the engine runs on.

- `proc/pressure/cpu`: `some avg10` = % of the last 10 s at least one runnable task waited for a CPU (`full` is
  reported by the kernel for the whole system as 0 since Linux 5.13; kept for cgroup-style files).
- `proc/stat`: the `cpu` line's jiffies (busy and total, summed over CPUs), the `cpuN` lines (how many), and
  `procs_running` (the run queue: runnable tasks, the reader itself included).
- `proc/<engine pid>/stat`: the engine's own utime + stime, so that its threads are not counted as "another
  process": other_cores = (Δbusy - Δengine) / Δtotal * CPUs, the cores' worth of CPU time everything else used
  since the previous sample (what it got, not what it wanted: a `nice 19` job that yields counts for little).

Both counters are in USER_HZ ticks, so their ratio needs no clock. Over fewer than `MIN_TICKS_PER_CPU` ticks per
CPU (0.1 s at the usual 100 Hz) the deltas are noise: the previous figures stand.
"""

from __future__ import annotations

from dataclasses import dataclass

from sensors.root import Reader, Root

PROC_STAT = "proc/stat"
PSI_CPU = "proc/pressure/cpu"
MIN_TICKS_PER_CPU = 10


@dataclass(frozen=True, slots=True)
class Load:
    util_percent: float | None = None
    other_cores: float | None = None
    engine_cores: float | None = None
    run_queue: int | None = None
    psi_some_avg10: float | None = None
    psi_full_avg10: float | None = None


@dataclass(frozen=True, slots=True)
class _Counters:
    busy: int
    total: int
    cpus: int
    engine_pid: int | None
    engine: int | None  # the engine's utime + stime; None when it could not be read


def read_psi(reader: Reader, path: str) -> tuple[float | None, float | None]:
    """`some avg10=0.12 avg60=... total=...` / `full avg10=...` (memory and CPU pressure files share the format)."""
    out: dict[str, float | None] = {"some": None, "full": None}
    text = reader.text(path)
    for line in (text or "").splitlines():
        kind, _, rest = line.partition(" ")
        if kind in out:
            for item in rest.split():
                key, _, value = item.partition("=")
                if key == "avg10":
                    out[kind] = reader.parse(path, value)
    return out["some"], out["full"]


def _proc_stat(reader: Reader, path: str) -> tuple[int, int, int, int | None] | None:
    """(busy, total, cpus, procs_running) from proc/stat, None when unreadable."""
    text = reader.text(path)
    if text is None:
        return None
    busy = total = cpus = 0
    running: int | None = None
    seen = False
    for line in text.splitlines():
        key, _, rest = line.partition(" ")
        if key == "cpu":
            try:
                # user nice system idle iowait irq softirq steal guest guest_nice; guest time is already in user.
                ticks = [int(x) for x in rest.split()[:8]]
            except ValueError:
                reader.problem(path, f"not a cpu line: {line[:60]!r}")
                return None
            if len(ticks) < 4:
                reader.problem(path, f"short cpu line: {line[:60]!r}")
                return None
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            total = sum(ticks)
            busy, seen = total - idle, True
        elif key.startswith("cpu") and key[3:].isdigit():
            cpus += 1
        elif key == "procs_running" and rest.strip().isdigit():
            running = int(rest)
    if not seen or cpus == 0:
        reader.problem(path, "no cpu lines")
        return None
    return busy, total, cpus, running


def _process_ticks(reader: Reader, root: Root, pid: int) -> int | None:
    """utime + stime of a process; None when it is gone (or absent from a fake tree): that is normal, not a fault."""
    path = root.path(f"proc/{pid}/stat")
    text = reader.optional_text(path)
    if text is None:
        return None
    # "pid (comm) state ppid ..." - comm may hold spaces and parentheses: split after the last ")".
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from the state (3)
    except (IndexError, ValueError):
        reader.problem(path, f"not a process stat line: {text[:60]!r}")
        return None


class LoadReader:
    """Keeps the previous counters; each `read` gives the figures over the interval since then."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self._stat = root.path(PROC_STAT)
        self._psi = root.path(PSI_CPU)
        self._prev: _Counters | None = None
        self._last = Load()

    def read(self, reader: Reader, engine_pid: int | None, *, stat: bool, psi: bool) -> Load:
        some, full = read_psi(reader, self._psi) if psi else (None, None)
        counters = _proc_stat(reader, self._stat) if stat else None
        running = counters[3] if counters is not None else None
        if counters is not None:
            busy, total, cpus, _ = counters
            engine = _process_ticks(reader, self.root, engine_pid) if engine_pid is not None else None
            now = _Counters(busy, total, cpus, engine_pid, engine)
            self._update(now)
        else:
            self._prev, self._last = None, Load()
        last = self._last
        return Load(last.util_percent, last.other_cores, last.engine_cores, running, some, full)

    def _update(self, now: _Counters) -> None:
        prev = self._prev
        if prev is None:
            self._prev = now
            return
        d_total, d_busy = now.total - prev.total, now.busy - prev.busy
        if d_total < MIN_TICKS_PER_CPU * now.cpus or d_busy < 0:
            if d_total < 0 or d_busy < 0:
                self._prev = now  # counters went back (a fake tree rewritten, a restored VM): start again
            return
        util = round(min(100.0, 100 * d_busy / d_total), 1)
        engine_cores: float | None = None
        if now.engine_pid is None:
            other = d_busy  # no engine: everything that ran is someone else
        elif now.engine_pid == prev.engine_pid and now.engine is not None and prev.engine is not None:
            d_engine = max(0, now.engine - prev.engine)
            engine_cores = round(now.cpus * min(d_engine, d_total) / d_total, 3)
            other = max(0, d_busy - d_engine)
        else:
            other = None  # the engine (re)started or cannot be read: its share of this interval is unknown
        other_cores = None if other is None else round(now.cpus * other / d_total, 3)
        self._last = Load(util, other_cores, engine_cores)
        self._prev = now
