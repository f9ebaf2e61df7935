"""Threads that fit the CPU the device really has free.

llama.cpp's worker threads wait for each other at every step of the graph: when another process holds one of the
cores, the thread that shares it stalls all the others (measured on 2 cores with one CPU hog: 2 threads 25 tok/s,
1 thread 48; on another VM 1.1-7.7 against 27-46: 4-40x; docs/contention.md). So each tick:

- cores taken = other processes' CPU demand (cores' worth, `Cpu.other_cores`, read back from the scheduler's shares
  when every core is busy) as a whole number with hysteresis: a core counts as taken at `take_fraction` of its time
  and is given back below `release_fraction`; counting it needs `enter_debounce_s`, giving it back `dwell_s` of
  continuous quiet **measured cleanly**: while the engine computes and every core is busy, what the others got is
  what the engine left them, not what they want, so such a sample is no evidence that they want less (issue 27: the
  hog's share beside a busy engine fell under a core and the threads came back, 15x slower), unless their demand
  was read back from the shares (below), which is what they want;
- threads <= online CPUs - cores taken, in every state;
- the engine's own measured decode tokens/s per thread count (learned online, per model and per number of cores
  taken) judges the counts: the fastest is used when it beats the count in force by `measure_margin`, fewer or
  more; a count that lost is **banned** for `measure_max_age_s` x (how many times slower it was)², doubled for each
  earlier loss of the same count at the same level (up to 8x), up to an hour (a count 15x slower is not tried again
  for the hour; one 20 % slower, for about three minutes, then six, twelve...), so a verdict is neither forgotten
  nor retried on a timer;
- one thread more is probed only where the cap's premise is in doubt: the run queue holds more of the others'
  runnable tasks than the cores the cap leaves them (on a busy machine the scheduler shares per thread, and more
  threads can win), or the run queue is unknown, in each of its last `QUEUE_TICKS` samples; a probe ends at its
  first measurement (`measure_settle_s` after it starts: a few tokens), at most `probe_max_s`, and a lost probe is
  banned as above.

Pure, like the rest of the policy: readings and the time in, a thread limit and its reason out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from policies.schema import Contention
from sensors.snapshot import Cpu, EngineObservation

ALPHA = 0.3  # weight of a new tokens/s sample in the running mean of its thread count
BAN_MAX_S = 3600.0  # a lost count is tried again at the latest after this long (its load level unchanged)
QUEUE_TICKS = 5  # run-queue samples a probe's premise must hold over (one is an instant)
LOSSES_MAX = 3  # each loss of the same count at the same load level doubles its ban, up to 8x


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
    passthrough: bool = False  # `measured` chose the ungoverned count over the policy's: governing was losing
    ungoverned_probe: bool = False  # `probe` tries the ungoverned count (never lose to nothing), not one more


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
        self._bans: dict[tuple[str, int, int], float] = {}  # (model, taken, threads) -> not tried again before
        self._losses: dict[tuple[str, int, int], int] = {}  # (model, taken, threads) -> losses before the last
        self._cpu: Cpu | None = None
        self._queues: deque[int | None] = deque(maxlen=QUEUE_TICKS)  # the run queue's last samples
        self._busy = False
        self._probe: tuple[int, float] | None = None  # (threads tried, since when)
        self._probe_t = -float("inf")  # when the last probe ended
        self._ungoverned: int | None = None  # this tick's ungoverned count, where it may be tried (`limit`)
        self.returning = False  # a probe just ended: going back is part of it (the state machine applies it at once)

    @property
    def pending(self) -> bool:
        """A core is about to count as taken: tick fast. (Giving one back waits a long dwell: no need.)"""
        return (self._want_since is not None and not self._falling) or self._probe is not None

    def contended(self, cpu: Cpu) -> bool:
        """Others hold cores (counted, or in this very sample: the count waits a debounce, the tokens/s do not) or a
        probe runs: tokens/s now say nothing about the device alone (the power allocator's model)."""
        other = cpu.other_cores
        return self.taken > 0 or self._probe is not None or (other is not None and other >= self.cfg.take_fraction)

    @property
    def saturated(self) -> bool:
        """Others want every core (all counted as taken): each engine thread's time is taken from them, not added to
        the cores' busy time, so the engine's threads and rate are not the die's watts; its clock is."""
        count = (self._cpu.count if self._cpu is not None else None) or 0
        return count > 0 and self.taken >= count

    def update(self, cpu: Cpu, engine: EngineObservation | None, rate_capped: bool, t: float) -> None:
        self._cpu = cpu
        self._queues.append(cpu.run_queue)
        # Under a rate cap the engine idles for part of each token by choice: its use says nothing of the sharing.
        threads = engine.threads if engine is not None and not rate_capped else None
        demand = self.demand(cpu, threads)
        # A demand read back from the shares is what the others want, not what the engine left them: evidence to fall
        # by (beside one hog, a level other engines raised stayed for a whole chat: 2 threads at half of 1's speed).
        read_back = demand is not None and cpu.other_cores is not None and demand > cpu.other_cores
        self._level(demand, cpu.count, t, clean=read_back or self._clean(cpu, engine))
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
            self._judge(engine.model, t)

    def _judge(self, model: str, t: float) -> None:
        """Every fresh count slower than the fastest by the margin is banned for max_age x (how much slower)²."""
        cfg = self.cfg
        fresh = {k: r for (m, taken, k), (r, at) in self._rates.items()
                 if m == model and taken == self.taken and t - at <= cfg.measure_max_age_s}  # fmt: skip
        top = max(fresh.values())
        for k, r in fresh.items():
            if r * (1 + cfg.measure_margin) < top:
                key, ratio = (model, self.taken, k), top / r
                if self._bans.get(key, -1.0) <= t:  # a new loss (not the same one judged again): the ban doubles
                    self._losses[key] = self._losses.get(key, -1) + 1
                ban = cfg.measure_max_age_s * ratio * ratio * 2 ** min(self._losses[key], LOSSES_MAX)
                self._bans[key] = t + min(BAN_MAX_S, ban)

    def banned(self, threads: int, t: float) -> bool:
        return self._bans.get((self._model or "", self.taken, threads), -1.0) > t

    def _clean(self, cpu: Cpu, engine: EngineObservation | None) -> bool:
        """What the others got is what they want: the engine is not computing, or some CPU is idle. While the engine
        computes on every core the others' use is only what it left them."""
        other, used, count, slack = cpu.other_cores, cpu.engine_cores, cpu.count, self.cfg.release_fraction
        if other is None or not count or engine is None or not engine.busy or used is None or used <= slack:
            return True
        return other + used < count - slack

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

    def _level(self, other: float | None, count: int | None, t: float, *, clean: bool = True) -> None:
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
        if want == self.taken or (want < self.taken and not clean):
            self._want_since = None  # a busy sample is no evidence of quiet: the dwell starts over
            return
        if self._want_since is None or self._falling != (want < self.taken):
            self._want_since, self._falling = t, want < self.taken
        if t - self._want_since >= (cfg.enter_debounce_s if want > self.taken else cfg.dwell_s):
            self.taken, self._want_since, self._stable_since = want, None, t

    def limit(self, threads: int, t: float, *, ungoverned: int | None = None) -> tuple[int, ThreadsNote | None]:
        """The thread count after the free-core cap, the measured verdicts and the probe; a note when any of them
        moved it off `threads`. `ungoverned`: the count the engine would run ungoverned (every CPU), where the policy
        chose fewer for speed (cores of different speed) and nothing asked for the loss: measured against the
        policy's count now and then (never lose to nothing); None: not to be tried."""
        cfg, cpu = self.cfg, self._cpu
        self.returning = False
        if not cfg.enabled or cpu is None:
            return threads, None
        self._ungoverned = ungoverned if ungoverned is not None and ungoverned > threads else None
        ceiling = max(threads, self._ungoverned or 0)
        count = cpu.count
        # Others want every core: whatever the count, each thread shares a core and waits at the barrier, and the
        # scheduler's per-thread shares give more threads more CPU; a cap would only cede them. No cap then.
        cap = count - self.taken if count and 0 < self.taken < count else None
        n = min(threads, cap) if cap is not None else threads
        measured = probe = None
        fresh = self._fresh(t)
        allowed = {k: r for k, r in fresh.items() if k <= ceiling and not self.banned(k, t)}
        if allowed:
            best = max(allowed, key=allowed.__getitem__)
            current = fresh.get(n)
            if self.banned(n, t) or (
                current is not None and best != n and allowed[best] > current * (1 + cfg.measure_margin)
            ):
                slower = current if current is not None else self._last(n)
                if slower is not None:
                    measured = (best, allowed[best], n, slower)
                n = best
        elif self.banned(n, t):  # the count the cap leaves lost before: its winner, however old its figure
            winner = self._winner(n, ceiling)
            if winner is not None:
                measured, n = winner, winner[0]
        tried = self._probing(n, threads, fresh, t)
        if tried is not None:
            probe, n = (tried, n, fresh[n]), tried
        passthrough = self._ungoverned is not None and n == self._ungoverned and measured is not None and probe is None
        if len(self._rates) > 64:
            self._rates = {k: v for k, v in self._rates.items() if t - v[1] <= BAN_MAX_S}
            self._bans = {k: v for k, v in self._bans.items() if v > t}
            self._losses = {k: v for k, v in self._losses.items() if k in self._bans}
        if n == threads and measured is None and probe is None:
            return threads, None
        bound = cap if cap is not None and cap < threads else None
        quiet = t - self._want_since if self._want_since is not None and self._falling else None
        note = ThreadsNote(
            cpu.other_cores,
            count,
            self.taken,
            cpu.psi_some_avg10,
            bound,
            measured,
            quiet,
            cfg.dwell_s,
            probe,
            passthrough,
        )
        return n, note

    def _last(self, threads: int) -> float | None:
        last = self._rates.get((self._model or "", self.taken, threads))
        return None if last is None else last[0]

    def _winner(self, lost: int, threads: int) -> tuple[int, float, int, float] | None:
        """The fastest count measured at this load level that is not banned, beside the banned one's figure."""
        model, taken = self._model or "", self.taken
        figures = {k: r for (m, lv, k), (r, _) in self._rates.items() if m == model and lv == taken and k <= threads}
        ok = {k: r for k, r in figures.items() if k != lost and (model, taken, k) not in self._bans}
        if not ok or lost not in figures:
            return None
        best = max(ok, key=ok.__getitem__)
        return best, ok[best], lost, figures[lost]

    def _fresh(self, t: float) -> dict[int, float]:
        """Measured tokens/s per thread count for the model and load level in force, within their age."""
        if self._model is None:
            return {}
        return {
            k: rate
            for (model, taken, k), (rate, at) in self._rates.items()
            if model == self._model and taken == self.taken and t - at <= self.cfg.measure_max_age_s
        }

    def _crowded(self, n: int) -> bool:
        """The others' runnable tasks (the run queue less the reader and the engine's threads while it computes)
        outnumber the cores the cap leaves them in each of the last `QUEUE_TICKS` samples: the scheduler then shares
        per thread, and one thread more may win despite the barrier. Unknown run queue: it may. One sample is an
        instant: the client reading the stream, the daemon forwarding it and the engine's server thread are runnable
        now and then, and one such instant beside a single hog made a probe of 2 threads on 2 cores (half the speed
        of 1)."""
        cpu, queues = self._cpu, self._queues
        if cpu is None or not cpu.count or not queues or any(q is None for q in queues):
            return True
        busy = n if self._busy else 0
        return min(q for q in queues if q is not None) - 1 - busy > cpu.count - n

    def _probing(self, n: int, threads: int, fresh: dict[int, float], t: float) -> int | None:
        """The count to try instead of `n` (one more thread where the run queue says so; the ungoverned count where
        the policy chose fewer), or None. Pure bookkeeping on readings and time."""
        cfg = self.cfg
        if self._probe is not None:
            tried, since = self._probe
            at = self._rates.get((self._model or "", self.taken, tried), (0.0, -float("inf")))[1]
            if at < since and t - since < cfg.probe_max_s and tried in (n + 1, self._ungoverned) and n in fresh:
                return tried
            self._probe, self._probe_t = None, t  # measured (or given up): the verdicts judge from here
            self.returning = True
            return None
        if not (
            cfg.probe_interval_s > 0
            and self._busy
            and n in fresh
            and self._threads == n
            and t - self._stable_since >= cfg.probe_interval_s
            and t - self._probe_t >= cfg.probe_interval_s
        ):
            return None
        options = [self._ungoverned, n + 1 if n < threads and self._crowded(n) else None]
        for option in options:
            if option is not None and option > n and option not in fresh and not self.banned(option, t):
                self._probe = (option, t)
                return option
        return None

    def readings(self) -> dict[str, float | None]:
        cpu = self._cpu
        return {
            "cpu_other_cores": None if cpu is None else cpu.other_cores,
            "cpu_psi_some_avg10": None if cpu is None else cpu.psi_some_avg10,
            "cores_taken": float(self.taken),
        }
