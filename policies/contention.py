"""Threads that fit the CPU the device really has free.

llama.cpp's worker threads wait for each other at every step of the graph: when another process holds one of the
cores, the thread that shares it stalls all the others (measured on 2 cores with one CPU hog: 2 threads 25 tok/s,
1 thread 48; docs/policies.md). So each tick:

- cores taken = other processes' CPU use (cores' worth, `Cpu.other_cores`) as a whole number with hysteresis: a core
  counts as taken at `take_fraction` of its time and is given back below `release_fraction`; counting it needs
  `enter_debounce_s`, giving it back `dwell_s` of continuous quiet (a short burst or a noisy load cannot thrash);
- threads <= online CPUs - cores taken, in every state;
- the engine's measured decode tokens/s per thread count (learned online from its observation, per model and per
  number of cores taken, forgotten after `measure_max_age_s`) confirms or corrects that: the count that measured
  fastest is used when it beat the count in force by `measure_margin`, fewer or more (more can win on a busy machine:
  the scheduler shares per thread, so with many runnable tasks two threads get twice the CPU of one). Forgetting
  re-measures now and then, so a wrong verdict does not last;
- the capped count is the only one measured under the load, so one thread more is probed: once the count has held
  `probe_interval_s` with the engine busy, one more thread runs until it is measured (at most `probe_max_s`); a probe
  that loses doubles the wait before the next (up to 8x, reset when the load level or model changes), and its
  measurement keeps the verdict for `measure_max_age_s`, so a noisy load cannot make the count flap.

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
    measured: tuple[int, float, int, float] | None  # (threads chosen, their tok/s, the count they beat, its tok/s)
    quiet_s: float | None = None  # the load fell: quiet this long of the dwell before threads come back
    dwell_s: float = 0.0
    probe: tuple[int, int, float] | None = None  # (threads tried, the count in force, its tok/s): an upward probe


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
        self._busy = False
        self._probe: tuple[int, float] | None = None  # (threads tried, since when)
        self._probe_key: tuple[str, int] | None = None  # (model, taken) the probes' back-off belongs to
        self._probe_losses = 0  # probes lost in a row under that key: the wait doubles with each
        self._probe_t = -float("inf")  # when the last probe ended

    @property
    def pending(self) -> bool:
        """A core is about to count as taken: tick fast. (Giving one back waits a long dwell: no need.)"""
        return (self._want_since is not None and not self._falling) or self._probe is not None

    def contended(self, cpu: Cpu) -> bool:
        """Others hold cores (counted, or in this very sample: the count waits a debounce, the tokens/s do not) or a
        probe runs: tokens/s now say nothing about the device alone (the power allocator's model)."""
        other = cpu.other_cores
        return self.taken > 0 or self._probe is not None or (other is not None and other >= self.cfg.take_fraction)

    def update(self, cpu: Cpu, engine: EngineObservation | None, rate_capped: bool, t: float) -> None:
        self._cpu = cpu
        # Under a rate cap the engine idles for part of each token by choice: its use says nothing of the sharing.
        threads = engine.threads if engine is not None and not rate_capped else None
        self._level(self.demand(cpu, threads), cpu.count, t)
        self._busy = engine is not None and engine.busy
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

    def demand(self, cpu: Cpu, threads: int | None) -> float | None:
        """Cores' worth the other processes want. What they got, unless every core is busy and the engine's threads
        got less than a core each: then the scheduler shared the cores per runnable thread, and the others wanted
        their use x the engine's threads / the engine's use (a build's 8 tasks on 4 cores beside 4 engine threads
        get 2.7 cores: 8 wanted, more than there are)."""
        other, engine, count, slack = cpu.other_cores, cpu.engine_cores, cpu.count, self.cfg.release_fraction
        if other is None or engine is None or not count or not threads or engine <= slack:
            return other
        if other + engine >= count - slack and engine < threads - slack:
            return other * threads / engine
        return other

    def _level(self, other: float | None, count: int | None, t: float) -> None:
        cfg = self.cfg
        if other is None or not count:
            self._want_since = None  # unknown keeps the level as it was
            return
        # Every core counts as taken only when the others want (nearly) all of them: no free core for any thread
        # count (see `limit`); otherwise at least one core is the engine's.
        top = count if other >= count - cfg.release_fraction else count - 1
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
        """The thread count after the free-core cap, the measured correction and the probe; a note when any of them
        moved it off `threads`."""
        cfg, cpu = self.cfg, self._cpu
        if not cfg.enabled or cpu is None:
            return threads, None
        count = cpu.count
        # Others want every core: whatever the count, each thread shares a core and waits at the barrier, and the
        # scheduler's per-thread shares give more threads more CPU; a cap would only cede them. No cap then.
        cap = count - self.taken if count and 0 < self.taken < count else None
        n = min(threads, cap) if cap is not None else threads
        measured = probe = None
        fresh = self._fresh(t)
        current = fresh.get(n)
        if current is not None:
            best = max((k for k in fresh if k <= threads), key=fresh.__getitem__)
            if best != n and fresh[best] > current * (1 + cfg.measure_margin):
                measured, n = (best, fresh[best], n, current), best
        elif self._threads is not None and n < self._threads <= threads and self._threads in fresh:
            # Running above the cap on a verdict whose other side has aged: stay while the count in force keeps
            # beating the capped count's last measurement (going back to re-measure it would dip every max age).
            last = self._rates.get((self._model or "", self.taken, n))
            if last is not None and fresh[self._threads] > last[0] * (1 + cfg.measure_margin):
                measured, n = (self._threads, fresh[self._threads], n, last[0]), self._threads
        tried = self._probing(n, threads, fresh, t)
        if tried is not None:
            probe, n = (tried, n, fresh[n]), tried
        if len(self._rates) > 64:
            self._rates = {k: v for k, v in self._rates.items() if t - v[1] <= cfg.measure_max_age_s}
        if n == threads and measured is None and probe is None:
            return threads, None
        bound = cap if cap is not None and cap < threads else None
        quiet = t - self._want_since if self._want_since is not None and self._falling else None
        note = ThreadsNote(
            cpu.other_cores, count, self.taken, cpu.psi_some_avg10, bound, measured, quiet, cfg.dwell_s, probe
        )
        return n, note

    def _fresh(self, t: float) -> dict[int, float]:
        """Measured tokens/s per thread count for the model and load level in force, within their age."""
        if self._model is None:
            return {}
        return {
            k: rate
            for (model, taken, k), (rate, at) in self._rates.items()
            if model == self._model and taken == self.taken and t - at <= self.cfg.measure_max_age_s
        }

    def _probing(self, n: int, threads: int, fresh: dict[int, float], t: float) -> int | None:
        """The count to try instead of `n` (one more thread), or None. Pure bookkeeping on readings and time."""
        cfg = self.cfg
        key = (self._model or "", self.taken)
        if key != self._probe_key:  # another load level or model: the back-off starts over
            self._probe_key, self._probe_losses, self._probe = key, 0, None
        if self._probe is not None:
            tried, since = self._probe
            at = self._rates.get((key[0], key[1], tried), (0.0, -float("inf")))[1]
            if at < since and t - since < cfg.probe_max_s and tried == n + 1 and n in fresh:
                return tried
            self._probe, self._probe_t = None, t  # measured (or given up): the correction judges from here
            won = tried in fresh and n in fresh and fresh[tried] > fresh[n] * (1 + cfg.measure_margin)
            self._probe_losses = 0 if won else min(self._probe_losses + 1, 3)
            return None
        wait = cfg.probe_interval_s * 2**self._probe_losses
        if (
            cfg.probe_interval_s > 0
            and self._busy
            and n < threads
            and n in fresh
            and n + 1 not in fresh
            and self._threads == n
            and t - self._stable_since >= cfg.probe_interval_s
            and t - self._probe_t >= wait
        ):
            self._probe = (n + 1, t)
            return n + 1
        return None

    def readings(self) -> dict[str, float | None]:
        cpu = self._cpu
        return {
            "cpu_other_cores": None if cpu is None else cpu.other_cores,
            "cpu_psi_some_avg10": None if cpu is None else cpu.psi_some_avg10,
            "cores_taken": float(self.taken),
        }
