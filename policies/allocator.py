"""The hot controller's power budget and its allocation, as the kernel's power_allocator divides its budget.

The PI controller (policies/controller.py, the power_allocator law) outputs u in [0, 1]: the share of the device's full
dynamic power it may use (all allowed threads at the top clock). The allocator turns that budget into the
configuration with the most tokens/s that fits: frequency cap x threads x rate cap.

Why a frequency cap first: a compute-bound decode's throughput falls linearly with the clock while its power falls as
f^k (k = 2-2.5, f·V² with the voltage following f), so n threads at a lower clock beat fewer threads at the top clock
for the same watts. Where decode is memory-bound, clock above the point where compute meets the memory ceiling buys
nothing, and the model learns where that point is.

The predictions come from `DeviceModel` (policies/devicemodel.py), measured online; `PowerAllocator` is the state
machine's part: it feeds the model, allocates in hot and critical, and brings the clock cap back after. Everything here
is pure and cheap: one tick scores a few dozen configurations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from policies.decision import KvType, State
from policies.devicemodel import DeviceModel
from policies.memfit import ModelFootprint
from policies.schema import Policy, Power, all_of
from sensors.snapshot import Battery, EngineObservation

TIE = 0.01  # choices within 1 % of the best: take the one with fewer watts (then fewer threads)
RATE_DEADBAND = 0.05  # a new rate cap within 5 % of the last one keeps the last one
CAP_BELOW = 0.95  # uncapped, a rate cap starts when it would hold the engine under 95 % of its speed ...
LIFT_ABOVE = 0.99  # ... and, capped, lifts above 99 %: the PI's wobble between them is not a reconfiguration
FREQ_STEP = 0.1  # coming back from hot, the clock cap rises by this share of the top clock per recover step

Key = tuple[float, float, int, float]  # (tokens/s within the budget, load, threads, clock)


def steady(rate: float | None, last: float | None) -> float | None:
    """A new rate cap within `RATE_DEADBAND` of the last one keeps the last one: the PI's wobble is not a
    reconfiguration."""
    if rate is not None and last is not None and abs(rate - last) <= RATE_DEADBAND * last:
        return last
    return rate


class Choice(NamedTuple):
    threads: int
    freq_ratio: float
    rate: float | None  # the rate cap needed to stay in budget; None: no cap needed
    tok_s: float | None  # predicted tokens/s (None until the engine has been measured)
    power_w: float  # predicted watts (idle included)
    budget_w: float
    alternative: Choice | None = None  # the best choice with other threads, for the explanation


def allocate(
    model: DeviceModel,
    u: float,
    *,
    threads: Sequence[int],
    ratios: Sequence[float],
    full_threads: int,
    max_rate: float | None,
    min_rate: float | None,
    prefill: bool = False,
) -> Choice:
    """The (threads, clock, rate) with the most predicted tokens/s within the budget u x full dynamic power.
    `prefill`: the engine is evaluating a prompt, which is compute-bound: the memory ceiling does not apply.

    A configuration that fits the budget uncapped beats a rate-capped one (between two clock steps the PI dithers the
    clock, a sysfs write, rather than the engine's rate cap, a reconfiguration; the cap is for budgets under every
    step); among those, the most tokens/s, and within 1 % of the most, the fewest watts, then the fewest threads. The
    alternative for the explanation is the same pick among the other thread counts. Plain loops: every tick."""
    budget = max(0.0, u) * model.load(full_threads, 1.0)  # in load units (threads' power share · f^k)
    limit = budget * (1 + 1e-9)
    budget_w = model.idle_w + model.core_w * budget
    a = model.a or 1.0
    ceiling = math.inf if prefill or model.ceiling is None else model.ceiling
    cells = model.grid(threads, ratios)
    speed = model.cores.speed
    toks: list[tuple[bool, float]] = []  # per cell: fits the budget uncapped, tokens/s within the budget
    # The most tokens/s among the cells that fit (and among those that do not), the threads of a cell that has it,
    # and the most among the cells with other threads: the alternative's "most" needs no pass of its own.
    fit_top, fit_n, fit_other = -1.0, 0, -1.0
    cap_top, cap_n, cap_other = -1.0, 0, -1.0
    for n, f, load in cells:
        tok = a * speed(n) * f
        if tok > ceiling:  # noqa: PLR1730 (hot path: min() is a call per cell)
            tok = ceiling
        if load <= limit:
            toks.append((True, tok))
            if tok > fit_top:
                if n != fit_n:
                    fit_other = fit_top
                fit_top, fit_n = tok, n
            elif n != fit_n and tok > fit_other:
                fit_other = tok
        else:  # over budget: the rate cap would take the rest, so tokens/s scale with budget / load
            tok = tok * budget / load
            toks.append((False, tok))
            if tok > cap_top:
                if n != cap_n:
                    cap_other = cap_top
                cap_top, cap_n = tok, n
            elif n != cap_n and tok > cap_other:
                cap_other = tok
    fits = fit_top >= 0  # any cell fits: only those compete
    best = _first(cells, toks, fits, fit_top if fits else cap_top, None)
    assert best is not None  # threads and ratios are never empty
    other = None  # the same pick among the other thread counts
    fit_most = fit_other if best[2] == fit_n else fit_top  # among the cells without best's threads (-1: none)
    cap_most = cap_other if best[2] == cap_n else cap_top
    if fit_most >= 0:
        other = _first(cells, toks, True, fit_most, best[2])
    elif cap_most >= 0:
        other = _first(cells, toks, False, cap_most, best[2])
    alt = None
    if other is not None:
        alt = _choice(model, other, budget=budget, budget_w=budget_w, max_rate=max_rate, min_rate=min_rate)
    return _choice(model, best, budget=budget, budget_w=budget_w, max_rate=max_rate, min_rate=min_rate, alt=alt)


def _first(
    cells: Sequence[tuple[int, float, float]],
    toks: Sequence[tuple[bool, float]],
    fits: bool,
    most: float,
    not_threads: int | None,
) -> Key | None:
    """The first cell (the fewest watts, then the fewest threads) that fits as asked, has not `not_threads` threads
    and comes within 1 % of `most` tokens/s; None: none."""
    floor = most * (1 - TIE)
    for (n, f, load), (cell_fits, tok) in zip(cells, toks, strict=True):
        if cell_fits is fits and tok >= floor and n != not_threads:
            return (tok, load, n, f)
    return None


def _choice(
    model: DeviceModel,
    key: Key,
    *,
    budget: float,
    budget_w: float,
    max_rate: float | None,
    min_rate: float | None,
    alt: Choice | None = None,
) -> Choice:
    tok, load, n, f = key
    rate: float | None = None
    if load > budget * (1 + 1e-9):  # over budget even at its lowest clock: the rate cap takes the rest
        if model.a is not None:
            rate = round(tok, 1)
        elif max_rate is not None:
            low = min_rate if min_rate is not None else max_rate
            rate = round(low + (budget / load) * (max_rate - low), 1)  # unmeasured: the profile's bounds
        if rate is not None:
            rate = max(rate, min_rate if min_rate is not None else 0.1)  # a cap of 0 would stop the answer
    if rate is not None and max_rate is not None:
        rate = min(rate, max_rate)
    duty = min(1.0, budget / load) if load > 0 else 1.0
    return Choice(
        threads=n,
        freq_ratio=f,
        rate=rate,
        tok_s=tok if model.a is not None else None,
        power_w=model.power_at(load, duty),
        budget_w=budget_w,
        alternative=alt,
    )


class PowerAllocator:
    """The state machine's part for power: the device model, the allocation in hot and critical, the clock cap."""

    def __init__(
        self,
        policy: Policy,
        freq_ratios: Sequence[float] | None,
        prior: Power | None,
        footprints: Mapping[str, ModelFootprint] | None = None,
    ) -> None:
        self._footprints = footprints or {}
        self._kv_share: dict[tuple[str, KvType], float] = {}
        ratios = sorted({r for r in freq_ratios or () if 0 < r <= 1} | {1.0})
        self.ratios = tuple(ratios) if policy.power.freq_cap and len(ratios) > 1 else None
        self.hot = policy.states[State.HOT]
        self.model = DeviceModel(prior if prior is not None else policy.power)
        self.choice: Choice | None = None  # this tick's allocation (None outside hot and critical)
        self.freq: float | None = None  # the clock cap in force (None: none)
        self._freq_t = -math.inf
        self._rate: float | None = None  # the rate cap last allocated
        self._guard_c = policy.power.guard_margin_c
        self._budget_freq: float | None = None  # the top clock the last budget allowed: the ramp's start
        self._last_temp: float | None = None  # the binding zone's reading at the last tick in hot (the guard's)

    @property
    def enabled(self) -> bool:
        """A clock cap is writable and the policy allows it: hot allocates a power budget."""
        return self.ratios is not None

    def full_threads(self, cpus: int | None) -> int:
        """Hot's threads on this CPU: at most its count and the CPUs online, the fastest such count on its cores."""
        return max(1, self.model.cores.best(all_of(self.hot.thread_limit, cpus)))

    def level(self, threads: int, cpus: int | None) -> float:
        """The share of full dynamic power the configuration in force uses: the PI's bumpless start."""
        full = self.model.load(self.full_threads(cpus), 1.0)
        return min(1.0, self.model.load(threads, self.freq or 1.0) / full)

    def guard(self, u: float, temp_c: float | None, trip_c: float, threads: int | None, cpus: int | None) -> float:
        """The trip guard: within `guard_margin_c` of the trip and still rising, the budget is at most the power of
        one clock step under the one in force (at the threads in force), as the kernel's step_wise takes a step per
        poll above the trip, but before it. The PI's gains are set for the setpoint's slow drift (k_po ~0.1 per °C):
        a step in load (a prompt, a build ending) at a setpoint 0.5 °C under the trip heats the die past it in a few
        seconds before the PI has cut a clock step. Returns the budget to allocate (u, or the lower level)."""
        last, self._last_temp = self._last_temp, temp_c
        if self.ratios is None or temp_c is None or last is None or threads is None:
            return u
        if temp_c < trip_c - self._guard_c or temp_c <= last:
            return u
        below = [r for r in self.ratios if r < (self.freq or 1.0) - 1e-9]
        full = self.model.load(self.full_threads(cpus), 1.0)
        if below and temp_c < trip_c <= temp_c + (temp_c - last):
            # At the trip by the next tick at this rise (a small die under a step in load: fleet:2:108's 2.1 J/K die
            # rose 0.2-0.3 °C a tick, past the trip while the clock came down a step a tick): the lowest clock now.
            # Over the trip, a step a tick (as step_wise).
            return min(u, self.model.load(threads, self.ratios[0]) / full)
        if below:
            return min(u, self.model.load(threads, below[-1]) / full)
        # At the lowest clock the step is one thread fewer (the kernel has no step left to take either).
        return min(u, self.model.load(threads - 1, self.ratios[0]) / full) if threads > 1 else u

    def allocate(
        self, u: float, cpus: int | None, *, prefill: bool = False, contended: bool = False, saturated: bool = False
    ) -> Choice:
        """`prefill`: the engine is busy with no tokens coming (a prompt): compute-bound, the clock is worth all of
        its watts; while decoding at the memory ceiling the clock above the crossover buys nothing.
        `contended`: other processes hold cores: decode is paced by the engine's share of them, most of the clock's
        watts are theirs, and the model learns nothing (a ceiling not yet found stays unknown). Then the clock one step
        under the budget's is tried even when the budget does not bind, as step_wise takes a step at the trip (a build
        beside the chat on the fanless laptop: the top clock at 94.5 °C where `none` ran at 93 %, same tokens).
        `saturated`: others want every core: the cores are busy whatever the engine runs, and a thread or a rate cap
        it gives up goes to them, not to the die's watts; only the clock is spent (the engine's full threads, no rate
        cap: a build of 8 tasks on 4 cores heated the die to the trip, and hot's 1 thread at its lowest clock gave the
        engine 1/9 of the cores where `none`'s 4 got 4/12 at the kernel's lowest clock, fleet:2:81 0.82 x `none`)."""
        full = self.full_threads(cpus)
        ratios = self.ratios or (1.0,)
        choice = allocate(
            self.model,
            u,
            threads=range(full if saturated else min(self.hot.min_threads or 1, full), full + 1),
            ratios=ratios,
            full_threads=full,
            min_rate=self.hot.rate_range[0],
            max_rate=self.hot.rate_range[1],
            prefill=prefill,
        )
        limit = max(0.0, u) * self.model.load(full, 1.0) * (1 + 1e-9)  # the top clock within the budget
        self._budget_freq = next(
            (r for r in reversed(ratios) if self.model.load(choice.threads, r) <= limit), choice.freq_ratio
        )
        if not prefill and (u < 1.0 or contended):
            choice = self._explore(choice, ratios)
        last, rate = self._rate, None if saturated else choice.rate
        speed = self.model.speed(choice.threads, choice.freq_ratio)
        threshold = (CAP_BELOW if last is None else LIFT_ABOVE) * speed  # hysteresis on the duty (rate ÷ speed)
        if self.model.a is not None and rate is not None and rate >= threshold:
            rate = None
        rate = steady(rate, last)
        if rate != choice.rate:
            choice = choice._replace(rate=rate)
        self._rate = choice.rate
        self.choice = choice
        return choice

    def _explore(self, choice: Choice, ratios: Sequence[float]) -> Choice:
        """Decoding at the memory ceiling (or with none known yet): try the next clock down unless it was measured
        slower lately. If decode holds there, the ceiling shows (two clocks, one rate) and the allocation stays (the
        same tokens for f^k less power); if not, that figure keeps it from being tried again for RECENT_OBS ticks
        (policies/devicemodel.py; a compute-bound device pays one tick a step slower now and then). The crossover,
        found without a bench."""
        model, ceiling, tok = self.model, self.model.ceiling, choice.tok_s
        if choice.rate is not None or tok is None or (ceiling is not None and tok < (1 - TIE) * ceiling):
            return choice  # under the ceiling: compute-bound, a lower clock costs tokens
        below = [r for r in ratios if r < choice.freq_ratio - 1e-9]
        if not below or model.measured_below(choice.threads, below[-1], (1 - TIE) * (ceiling or tok)):
            return choice
        f = below[-1]
        return choice._replace(
            freq_ratio=f, tok_s=model.speed(choice.threads, f), power_w=model.power_w(choice.threads, f)
        )

    def context(self, engine: EngineObservation | None, kv_type: KvType) -> None:
        """The engine's context fill, for the memory ceiling at it (unknown fill or model: one ceiling)."""
        if engine is None or engine.context_tokens is None or engine.model is None:
            self.model.set_context(0.0, 0.0)
            return
        key = (engine.model, kv_type)
        share = self._kv_share.get(key)
        if share is None:
            fp = self._footprints.get(engine.model)
            share = fp.kv_bytes(1, kv_type) / fp.file_bytes if fp is not None and fp.file_bytes > 0 else 0.0
            self._kv_share[key] = share
        self.model.set_context(engine.context_tokens, share)

    def observe(
        self,
        threads: int,
        rate_cap: float | None,
        freq_ratio: float | None,
        engine: EngineObservation | None,
        *,
        battery: Battery | None,
        on_power: bool,
        slow: bool = False,
    ) -> None:
        """Teach the model what the configuration in force (`threads`, `rate_cap`; `slow`: on the slowest cluster
        alone) did: tokens/s, and watts where a battery says."""
        if engine is None or not engine.busy:
            return
        if engine.model is not None:
            self.model.switch_model(engine.model)
        freq = self.freq or 1.0
        if freq_ratio is not None:
            freq = min(freq, freq_ratio)  # the kernel's own throttling counts too
        watts = battery.power_w if battery is not None and not on_power else None
        self.model.observe(threads, freq, engine.tokens_per_s, rate_cap, watts, slow=slow)

    def freq_now(self, t: float, recover_step_s: float) -> float | None:
        """The clock cap: the allocator's in hot and critical; coming back it starts from the clock the last budget
        allowed and rises a tenth of the top clock per recover step (thermald un-throttles one step at a time), as
        threads come back one at a time."""
        if self.choice is None:
            self._last_temp = None  # the guard compares readings in hot only
        if self.choice is not None:
            self._freq_t = t
            self.freq = None if self.choice.freq_ratio >= 1.0 else self.choice.freq_ratio
        elif self._budget_freq is not None:  # the first tick out of hot: the ramp starts from the budget's clock,
            # not from one chosen lower at the memory ceiling for energy, which the next prompt would pay for
            if self.freq is not None and self._budget_freq > self.freq:
                self.freq = None if self._budget_freq >= 1.0 else self._budget_freq
            self._budget_freq = None
        elif self.freq is not None and self.ratios is not None and t - self._freq_t >= recover_step_s:
            self._freq_t = t
            up = next((r for r in self.ratios if r >= self.freq + FREQ_STEP - 1e-9), 1.0)
            self.freq = None if up >= 1.0 else up
        return self.freq
