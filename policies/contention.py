"""Threads that fit the CPU the device really has free.

llama.cpp's worker threads wait for each other at every step of the graph: when another process holds one of the
cores, the thread that shares it stalls all the others (measured on 2 cores with one CPU hog: 2 threads 25 tok/s,
1 thread 48; docs/policies.md). So each tick:

- cores taken = other processes' CPU use (cores' worth, `Cpu.other_cores`) as a whole number with hysteresis: a core
  counts as taken at `take_fraction` of its time and is given back below `release_fraction`; counting it needs
  `enter_debounce_s`, giving it back `dwell_s` of continuous quiet (a short burst or a noisy load cannot thrash);
- threads <= online CPUs - cores taken, in every state;
- the engine's measured decode tokens/s per thread count (learned online from its observation, per model and per
  number of cores taken, forgotten after `measure_max_age_s`) confirms or corrects that: when fewer threads measured
  faster by `measure_margin`, fewer are used. Forgetting re-measures now and then, so a wrong verdict does not last.

Pure, like the rest of the policy: readings and the time in, a thread limit and its reason out.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.schema import Contention
from sensors.snapshot import Cpu, EngineObservation

ALPHA = 0.3  # weight of a new tokens/s sample in the running mean of its thread count


@dataclass(frozen=True, slots=True)
class ThreadsNote:
    """Why contention lowered the thread count this tick, for the explanation."""

    other_cores: float | None
    count: int | None
    taken: int
    psi: float | None
    cap: int | None  # threads the free cores allow, when that bound
    measured: tuple[int, float, int, float] | None  # (fewer threads, their tok/s, the count they beat, its tok/s)
    quiet_s: float | None = None  # the load fell: quiet this long of the dwell before threads come back
    dwell_s: float = 0.0


class ThreadFit:
    def __init__(self, cfg: Contention) -> None:
        self.cfg = cfg
        self.taken = 0
        self._want_since: float | None = None  # when the raw level started to differ from `taken`
        self._falling = False  # ... and whether it is below it
        self._stable_since = 0.0  # since when the engine's threads and the level are what they are
        self._threads: int | None = None
        self._model: str | None = None
        self._rates: dict[tuple[str, int, int], tuple[float, float]] = {}  # (model, taken, threads) -> (tok/s, t)
        self._cpu: Cpu | None = None

    @property
    def pending(self) -> bool:
        """A core is about to count as taken: tick fast. (Giving one back waits a long dwell: no need.)"""
        return self._want_since is not None and not self._falling

    def update(self, cpu: Cpu, engine: EngineObservation | None, rate_capped: bool, t: float) -> None:
        self._cpu = cpu
        self._level(cpu, t)
        if engine is None:
            return
        if engine.threads != self._threads or engine.model != self._model:
            self._threads, self._model, self._stable_since = engine.threads, engine.model, t
        rate = engine.tokens_per_s
        if (
            engine.busy
            and not rate_capped  # a rate cap bounds the delivered rate: it says nothing of the threads
            and rate is not None
            and rate > 0
            and engine.threads is not None
            and engine.model is not None
            and t - self._stable_since >= self.cfg.measure_settle_s
        ):
            key = (engine.model, self.taken, engine.threads)
            old = self._rates.get(key)
            fresh = old is not None and t - old[1] <= self.cfg.measure_max_age_s
            self._rates[key] = ((1 - ALPHA) * old[0] + ALPHA * rate if fresh and old else rate, t)

    def _level(self, cpu: Cpu, t: float) -> None:
        other, count, cfg = cpu.other_cores, cpu.count, self.cfg
        if other is None or not count:
            self._want_since = None  # unknown keeps the level as it was
            return
        top = count - 1  # at least one core is always the engine's
        up = min(top, max(0, int(other + 1 - cfg.take_fraction)))
        down = min(top, max(0, int(other + 1 - cfg.release_fraction)))
        want = up if up > self.taken else down if down < self.taken else self.taken
        if want == self.taken:
            self._want_since = None
            return
        if self._want_since is None or self._falling != (want < self.taken):
            self._want_since, self._falling = t, want < self.taken
        if t - self._want_since >= (cfg.enter_debounce_s if want > self.taken else cfg.dwell_s):
            self.taken, self._want_since, self._stable_since = want, None, t

    def limit(self, threads: int, t: float) -> tuple[int, ThreadsNote | None]:
        """The thread count after the free-core cap and the measured correction; a note when they lowered it."""
        cfg, cpu = self.cfg, self._cpu
        if not cfg.enabled or cpu is None:
            return threads, None
        count = cpu.count
        cap = max(1, count - self.taken) if count and self.taken else None
        n = min(threads, cap) if cap is not None else threads
        measured = None
        if self._model is not None:
            fresh = {
                k: rate
                for (model, taken, k), (rate, at) in self._rates.items()
                if model == self._model and taken == self.taken and t - at <= cfg.measure_max_age_s
            }
            current = fresh.get(n)
            fewer = [k for k in fresh if k < n]
            if current is not None and fewer:
                best = max(fewer, key=fresh.__getitem__)
                if fresh[best] > current * (1 + cfg.measure_margin):
                    measured = (best, fresh[best], n, current)
                    n = best
        if len(self._rates) > 64:
            self._rates = {k: v for k, v in self._rates.items() if t - v[1] <= cfg.measure_max_age_s}
        if n >= threads:
            return threads, None
        bound = cap if cap is not None and cap < threads else None
        quiet = t - self._want_since if self._want_since is not None and self._falling else None
        note = ThreadsNote(cpu.other_cores, count, self.taken, cpu.psi_some_avg10, bound, measured, quiet, cfg.dwell_s)
        return n, note

    def readings(self) -> dict[str, float | None]:
        cpu = self._cpu
        return {
            "cpu_other_cores": None if cpu is None else cpu.other_cores,
            "cpu_psi_some_avg10": None if cpu is None else cpu.psi_some_avg10,
            "cores_taken": float(self.taken),
        }
