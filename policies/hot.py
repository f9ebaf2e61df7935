"""The hot state's limits on the engine: the kernel power_allocator's PI output placed between the hot profile's
bounds (threads and rate cap), or, where the clock can be capped, a power budget the allocator spends on clock x
threads x rate (policies/allocator.py), with the guard that keeps the trip.

The state machine (policies/machine.py) asks for these limits while the state is hot, and for the hot profile at its
floor in critical. The PI starts bumpless from the power in use, and again once a zone reads after none did; where
the heat is not the engine's, hot steps aside (`Authority`, policies/authority.py).

Where the clock is not writable and the cores differ (a phone under Termux), the limits' power can buy more tokens on
the slowest cluster alone: hot's threads and rate cap are priced as a power budget (the device model's load of that
many of the fastest cores at the cap's duty) and the little cores take it when they are predicted `SLOW_GAIN` faster
within it (`slow`; policies/cores.py). While they run uncapped just under the setpoint (`HOLD_C`) the PI holds its
output: a budget they cannot use would wind it up until the big cores won it back, heating the zone past the setpoint
each time (the randomized phones: up to 2.2 config changes a minute). Further under it the PI goes on, so a zone with
room to spare gets the big cores back (always holding cost the shipped phone's long chat 2 % of its tokens).

Where the clock is not writable and the cores are alike, the kernel's passive trip is the better actuator: it lowers
the clock on every thread, f^(1-k) of the watts per token, where hot's threads and rate cap at the full clock cost the
same watts per token at any cut. When the cut the PI asks for is predicted `KERNEL_GAIN` slower than every thread at
the clock that cut's power allows, hot yields to the kernel (`_kernel`; the `Authority` brings it back), and only caps
the rate on every thread where the kernel's lowest clock cannot hold the zone under critical (`_over_trip`). Where
the clock is writable, hot yields the same way at the smallest tier worth a switch when the budget that keeps the trip
loses to every thread at the lowest clock over it (`losing`: a board whose idle power holds it just under its trip).

Pure: all state lives in the object.
"""

from __future__ import annotations

import math

from policies.allocator import CAP_BELOW, LIFT_ABOVE, PowerAllocator, steady
from policies.authority import FLOOR_U, Authority
from policies.ceiling import Ceiling
from policies.controller import PIController
from policies.decision import EngineConfig, State
from policies.readings import ThermalView
from policies.schema import Limits, Policy, all_of
from policies.tierstep import TierStep

SLOW_GAIN = 1.15  # the slowest cluster alone: when predicted this much faster within hot's power (back: 1 / this)
FLOOR_NEAR_C = 0.5  # ... at the PI's floor within this of the trip, their cap falls toward the floor's tokens
PROMPT_ROOM_C = 1.0  # a prompt gets hot's whole budget only this far under the setpoint
HOLD_C = 0.5  # ... running uncapped within this of the setpoint (under it), the PI's output holds
KERNEL_GAIN = 1.15  # alike cores, no writable clock: the kernel's clock steps take over when predicted this much faster
KERNEL_OVER_C = 1.0  # ... and hot's PI holds the zone at least this far over the trip where they cannot,
KERNEL_UNDER_CRITICAL_C = 1.5  # ... this far under critical's threshold
KERNEL_CAP_BELOW = 0.9  # ... capping once its output falls under this (lifted back at 1)
LOSING_S = 15.0  # a writable clock: hot's budget predicted LOSING_GAIN slower than the kernel's, on average this long
LOSING_GAIN = 1.05  # ... (the tokens goal's 0.97 and a margin: a prediction of the device alone, every thread)


class HotControl:
    def __init__(self, policy: Policy, power: PowerAllocator) -> None:
        self.policy = policy
        self.power = power
        self._limits = Limits.of(State.HOT, policy.states[State.HOT])
        self._pi: PIController | None = None
        self.u: float | None = None  # the PI's last output in [0, 1] (None: not controlling)
        self.authority = Authority()  # hot steps aside where the heat is not the engine's (policies/authority.py)
        self.ceiling = Ceiling()  # a thread count hot cut again soon after rising to it waits (policies/ceiling.py)
        self._capped = False  # the last `at` capped the rate (the cap's hysteresis)
        self.slow = False  # hot's threads run on the slowest cluster alone (no writable clock, cores that differ)
        self._slow_full = False  # ... uncapped: the power budget is more than they use
        self._slow_rate: float | None = None  # ... the rate cap they had
        self.prompt_fast = False  # ... but this tick a prompt under the setpoint: on the fastest cores
        self.saturated = False  # others want every core: hot spends the clock alone, or passes through without one
        self._kernel_capped = False  # ... and the PI over the trip caps the rate
        self._losing: tuple[float, float, float] | None = None  # a writable clock: (since, last, mean budget share)
        self._lost: str | None = None  # ... the model hot yielded with (the next spell in hot yields without the wait)
        self._alone = False  # `losing` may judge: the binding zone's own passive trip (not the policy's: a loss asked
        # for), and the device alone (no contention, no memory pressure: the ungoverned prediction holds)

    def reset(self) -> None:
        """The PI starts again, bumpless, the next time."""
        self._pi, self.u = None, None

    def leave(self, t: float) -> None:
        """Not hot: the PI starts again next time, and a step aside's back-off starts over."""
        self.slow = self._slow_full = self.prompt_fast = self._kernel_capped = self.saturated = False
        self._losing = None
        self.authority.aside(t, hot=False, u=self.u, throttled=None, temp_c=None)
        self.ceiling.leave()
        self.reset()

    def limits(
        self, view: ThermalView, *, untrusted: bool, throttled: bool | None, prev: EngineConfig | None, t: float,
        cpus: int | None, prefill: bool, contended: bool, saturated: bool = False, place: bool = True,
        pressure: bool = False,
    ) -> list[Limits]:  # fmt: skip
        """The hot limits of this tick (`throttled`: the kernel holds the clock down; `prefill`: the engine evaluates a
        prompt; `contended`: others hold cores (`saturated`: every core); `pressure`: memory pressure (with either,
        the ungoverned engine's prediction is not of the device alone: no `losing`); `place`: the slowest cluster may
        take them, in hot proper, not where critical for memory borrows hot's limits only while the zone is over the
        setpoint: there they come and go, and a move between clusters each way doubled the changes, fleet:2:181's
        burst 28.8 -> 41.7 a minute)."""
        # Where hot caps the clock, a zone under its trip is not held there by others: the kernel's step only waits
        # out its hysteresis, and takes no clock hot's floor has not (policies/authority.py).
        trip = view.trip_c if self.power.enabled else None
        self._alone = "passive trip" in view.trip_source and not (contended or pressure)
        # Others want every core: a thread or a rate cap the engine gives up goes to them, the cores stay busy and the
        # die's watts the same; with no clock to set, the kernel's throttling is all that keeps the trip, as for
        # `none` (fleet:2:191, a build on every core: hot cut the engine to 1 tok/s for 160 s until it stepped aside).
        # With a clock, its lowest step is the kernel's own: no stepping aside from it (that lifted the cap into a
        # spell over the trip as the build ended, and critical took the smallest model: fleet:2:2:laptop).
        aside = self.authority.aside(
            t, hot=True, u=None if saturated else self.u, throttled=throttled, temp_c=view.temp_c, trip_c=trip,
            held=saturated and not self.power.enabled,
        )  # fmt: skip
        # (with a clock, a step aside taken before the build began is not the build's: the why says aside)
        self.saturated = saturated and not (aside and self.power.enabled)
        over = view.temp_c is not None and view.temp_c >= view.setpoint_c
        # (threads on the slowest cluster are not a rise or cut of hot's thread count on the fastest cores)
        self.ceiling.observe(t, prev.threads if prev is not None and not self.slow else None, over_setpoint=over)
        most = self.ceiling.limit(t)
        self.ceiling.asked(None)
        out: list[Limits] = []
        if untrusted and view.temp_c is None:
            # No temperature to control on: the hot profile at its floor (threads, rate and clock as low as hot
            # goes), not the PI's last output (at start: the sustained profile, as if nothing were wrong). The PI
            # starts again, bumpless from these limits, once a zone reads.
            self.reset()
            out.append(self.at(0.0, cpus))
            if self.power.enabled:
                choice = self.power.allocate(0.0, cpus)
                out.append(self._limits.at(choice.threads, choice.rate))
            return out
        if aside and self.authority.kernel is not None and view.temp_c is not None:
            return self._over_trip(view, prev, t, cpus)
        if aside:  # the kernel throttles with hot's cut at its floor: pass-through; the PI restarts bumpless
            self.reset()
            self.slow = False
            return out
        self.prompt_fast = prefill and view.temp_c is not None and view.temp_c < view.setpoint_c
        near = view.temp_c is not None and view.setpoint_c - HOLD_C < view.temp_c < view.setpoint_c
        if self.slow and self._slow_full and near and self._pi is not None and self.u is not None:
            u = self.u  # the little cores use less than the budget, near the setpoint: hold it (then on from here)
            self._pi.start(view.setpoint_c, view.temp_c or view.setpoint_c, u, t)
        else:
            u = self._pi_output(view, prev, t, cpus)
        if not self.power.enabled:
            limits = self.at(u, cpus)
            if most is not None and limits.threads > most:  # the rate cap u places stays: one thread is no hotter
                limits = limits.at(most, limits.rate)
            kernel = self._kernel(limits, cpus, view, throttled) if place and not contended else None
            if kernel is not None:  # the kernel's clock steps beat hot's limits: pass-through; the PI restarts
                self.authority.yield_to_kernel(t, *kernel)
                self.reset()
                self._kernel_capped = False
                return self._over_trip(view, prev, t, cpus)
            if place:
                limits = self._place(limits, cpus, u, view)
            else:
                self.slow = self._slow_full = False
            out.append(limits)
            self.ceiling.asked(None if self.slow else limits.threads)
            return out
        # a power budget, allocated to clock x threads x rate
        if prefill and view.temp_c is not None and view.temp_c < view.setpoint_c - PROMPT_ROOM_C:
            # A prompt under the setpoint gets the whole budget, as `none` runs it: it is compute-bound (each
            # clock step costs time to first token) and short, and where decode is memory-bound the clock it
            # needs is lower; the PI's approach to the setpoint would cut it. The guard still keeps the trip. Not
            # within PROMPT_ROOM_C of it: there the whole budget takes a small die over the trip within a tick, the
            # kernel's step drops the setpoint and the budget to its floor, and the threads come back one per recover
            # step for minutes (fleet:2:57's long chat: 29 config changes, 0.88 x `none`'s tokens; now none, 0.99).
            u = 1.0
        guarded = self.power.guard(u, view.temp_c, view.trip_c, prev.threads if prev else None, cpus)
        if guarded < u and self._pi is not None and view.temp_c is not None:
            # Back-calculation: the PI goes on from the budget in force, not from the one the guard overrode.
            self._pi.start(view.setpoint_c, view.temp_c, guarded, t)
            self.u = u = guarded
        choice = self.power.allocate(u, cpus, prefill=prefill, contended=contended, saturated=saturated)
        out.append(self._limits.at(choice.threads, choice.rate))
        return out

    def _place(self, limits: Limits, cpus: int | None, u: float, view: ThermalView) -> Limits:
        """Hot's limits on the fastest cores, or the same power on the slowest cluster alone where that is predicted
        `SLOW_GAIN` faster (then `slow`): the fewest threads there within 1 % of their most speed, rate-capped to the
        budget where they would exceed it. With the PI at its floor and the zone within `FLOOR_NEAR_C` of the trip,
        their cap falls toward the tokens of hot's floor on the fastest cores, all the way at the trip: the floor stays
        a floor where the little cores draw more than the model's capacity² says (the shipped phone's 4 little cores,
        uncapped at the floor's budget, took its skin to the trip and the kernel throttled 32 % of the run)."""
        model = self.power.model
        cores = model.cores
        self._slow_full = False
        if not cores.slow_cpus or model.observations == 0:
            self.slow = False
            return limits
        n = cores.best(limits.threads)
        got, budget = self._priced(n, limits.rate)
        # As many threads there as add speed (a prompt is compute-bound and the rate cap does not pace it, so every
        # core shortens it); the rate cap holds decode within the budget
        best_k, top = 0, 0.0
        for k in range(1, min(len(cores.slow_cpus), all_of(self._limits.threads, cpus)) + 1):
            speed = model.speed(k, 1.0, slow=True)
            if speed > top * 1.01:
                best_k, top = k, speed
        best_tok = top * min(1.0, budget / model.load(best_k, 1.0, slow=True)) if best_k else 0.0
        self.slow = best_k > 0 and best_tok >= (1 / SLOW_GAIN if self.slow else SLOW_GAIN) * got
        if not self.slow:
            self._slow_rate = None
            return limits
        temp = view.temp_c  # at the PI's floor within FLOOR_NEAR_C of the trip: their cap falls toward the floor's
        near = 0.0 if temp is None or u > FLOOR_U else (temp - view.trip_c + FLOOR_NEAR_C) / FLOOR_NEAR_C
        floor = min(1.0, max(0.0, near))
        if floor > 0 and best_tok > got:
            best_tok -= (best_tok - got) * floor
        self._slow_full = floor == 0 and model.load(best_k, 1.0, slow=True) <= budget
        rate = None
        if not self._slow_full:
            rate = steady(max(self.policy.states[State.HOT].rate_range[0] or 0.1, round(best_tok, 1)), self._slow_rate)
        self._slow_rate = rate
        return limits.at(best_k, rate)

    def _over_trip(self, view: ThermalView, prev: EngineConfig | None, t: float, cpus: int | None) -> list[Limits]:
        """Yielded to the kernel's clock steps. Where they cannot hold the trip (every thread at the kernel's lowest
        clock still heats the zone past it, toward critical), a PI over the trip caps the rate on every thread: the
        kernel's lowest clock stays the cheapest. Only once its output is under `KERNEL_CAP_BELOW` (lifted back at 1): a
        cap over what the engine decodes limits nothing, but it keeps the threads from being measured (contention)."""
        self.slow = self._slow_full = False
        over = max(view.trip_c + KERNEL_OVER_C, view.critical_c - KERNEL_UNDER_CRITICAL_C)
        # (with a clock, the PI starts uncapped: the power in use was hot's budget under the trip, not the kernel's)
        u = self._pi_output(view._replace(setpoint_c=over), None if self.power.enabled else prev, t, cpus)
        self._kernel_capped = u < (1.0 if self._kernel_capped else KERNEL_CAP_BELOW)
        if not self._kernel_capped:
            return []
        capped = self.at(u, cpus)
        return [capped.at(self.power.full_threads(cpus), capped.rate)]

    def _kernel(
        self, limits: Limits, cpus: int | None, view: ThermalView, throttled: bool | None
    ) -> tuple[float, float] | None:
        """(hot's tokens/s, the kernel's) where the kernel's clock steps are predicted `KERNEL_GAIN` faster than hot's
        limits within the same power: alike cores, no writable clock, the zone's own passive trip and a clock that
        says when the kernel holds it. Threads and a rate cap at the full clock buy tokens linearly in watts; a lower
        clock on every thread buys them at f^(1-k) of the watts (the device model's k), so any cut deeper than a
        little loses to the kernel's throttling (issue 27: fleet:2:137's long chat, 0.43 x `none`'s tokens at 2.1 x
        its J/token). Where decode is memory-bound, fewer threads lose no speed and hot's cut stays."""
        model = self.power.model
        if model.cores.slow_cpus or model.observations == 0 or throttled is None or view.temp_c is None:
            return None
        if "passive trip" not in view.trip_source:  # the policy's own trip (a loss asked for), or none known
            return None
        full = self.power.full_threads(cpus)
        got, budget = self._priced(limits.threads, limits.rate)
        top = model.load(full, 1.0)
        if budget >= top or top <= 0:
            return None
        kernel = model.speed(full, math.pow(budget / top, 1 / model.k))
        return (got, kernel) if kernel >= KERNEL_GAIN * got else None

    def against_kernel(self, cpus: int | None) -> tuple[float, float] | None:
        """(tokens/s of this tick's allocation, of every thread at the clock table's lowest step: the deepest the
        kernel's throttling takes the ungoverned engine); None without an allocation (no writable clock, not hot)."""
        choice, ratios, model = self.power.choice, self.power.ratios, self.power.model
        if choice is None or ratios is None:
            return None
        governed = model.speed(choice.threads, choice.freq_ratio)
        if choice.rate is not None and model.a is not None:
            governed = min(governed, choice.rate)
        return governed, model.speed(self.power.full_threads(cpus), ratios[0])

    def losing(self, t: float, governed: float, ungoverned: float, *, tiers: TierStep | None, model: str) -> None:
        """Never lose to nothing, where the clock is hot's: every thread at the lowest clock heats the zone past its
        trip (a board idling a few degrees under it: hot's budget there is a fraction of a watt), the kernel lets the
        ungoverned engine run so, over the trip, and hot's budget decoding `governed` loses `LOSING_GAIN` to it. On
        average over `LOSING_S` of decoding (the PI's budget wobbles tick to tick), with no smaller tier to win it
        back (`tiers`, the ladder's step: policies/tierstep.py), on the zone's own passive trip: hot yields to the
        kernel (pass-through; `_over_trip` keeps the zone under critical), back as after others' heat (fleet:2:174:
        0.62-0.73 x `none`'s tokens at 85 °C, `none` at 95 °C, critical 101 °C). The ungoverned engine runs the largest
        tier: a smaller one that beats it does not yield (fleet:2:193's 0.5B, 1.1-2.7 x `none`'s 3B, under the trip).
        The verdict is the device's (its idle power near the trip): a later spell in hot with the same model yields as
        soon as its budget loses (each spell of a burst had waited a minute: fleet:2:174, 0.87 x `none`)."""
        if tiers is not None and tiers.share and ungoverned > 0:
            ungoverned = governed / tiers.share  # (the share in the largest tier's units)
        bottom = tiers is None or tiers.bottom(model)
        if not bottom or not self._alone or ungoverned <= 0:
            self._losing = None
            return
        share = governed / ungoverned
        since, last, mean = self._losing or (t, t, share)
        mean += (share - mean) * min(1.0, (t - last) / LOSING_S)
        self._losing = (since, t, mean)
        lost = self._lost == model  # (this tick's share: the PI's descent into the spell is no reason to wait)
        if (lost or t - since >= LOSING_S) and LOSING_GAIN * (share if lost else mean) < 1.0 and share < 1.0:
            self.authority.yield_to_kernel(t, governed, ungoverned, over=True)
            self._losing, self._lost = None, model
            self.reset()

    def _priced(self, threads: int, rate: float | None) -> tuple[float, float]:
        """(tokens/s, load) of `threads` of the fastest cores at the full clock under `rate`: a rate cap's duty idles
        the threads between tokens, so its load is that share of theirs."""
        model = self.power.model
        fast = model.speed(threads, 1.0)
        got = fast if rate is None else min(fast, rate)
        return got, model.load(threads, 1.0) * (got / fast if fast > 0 else 1.0)

    def _pi_output(self, view: ThermalView, prev: EngineConfig | None, t: float, cpus: int | None) -> float:
        setpoint, switch_on, temp = view.setpoint_c, view.hot_exit_c, view.temp_c
        hot = self.policy.states[State.HOT]
        if self._pi is None:
            gains = self.policy.thermal.pi
            self._pi = PIController.with_defaults(setpoint, switch_on, gains.k_pu, gains.k_po, gains.k_i)
            low = hot.min_threads or 1
            span = self.power.full_threads(cpus) - low
            level = 1.0 if prev is None or span == 0 else min(1.0, max(0.0, (prev.threads - low) / span))
            if self.power.enabled and prev is not None:  # the budget starts at the power in use: bumpless
                level = self.power.level(prev.threads, cpus)
            self._pi.start(setpoint, temp if temp is not None else setpoint, level, t)
            self.u = level
        if temp is not None:
            self.u = self._pi.update(setpoint, temp, t)
        return self.u if self.u is not None else 1.0

    def at(self, u: float, cpus: int | None) -> Limits:
        """The hot profile with threads and rate cap placed at u in [0, 1] between its bounds (monotone in u); its
        most threads: its count, at most the CPUs online, the fastest such count on its cores."""
        hot = self.policy.states[State.HOT]
        low = hot.min_threads or 1
        low_rate, top_rate = hot.rate_range
        top_rate = top_rate or 1.0  # validated present
        low_rate = low_rate or top_rate
        top = self.power.full_threads(cpus)
        threads = low + math.floor(u * max(0, top - low) + 0.5)
        # Relative to the device: where the engine was measured faster than the profile's top rate, u scales the cap
        # from its measured speed (a phone decoding 22 tok/s under a 12 tok/s top lost 45 % at u = 1, fleet:2:16),
        # and a cap at the top is no cap (with the allocator's hysteresis: not a change per tick).
        model = self.power.model
        full = model.speed(top, 1.0)
        relative = model.observations > 0 and full > top_rate
        if relative:
            top_rate = full
        rate = round(low_rate + u * (top_rate - low_rate), 1)
        # Lifted only near the top (not wherever fewer threads do not reach it: a lift and a cap again at each thread
        # step, two config changes for one cut).
        lifted = relative and rate >= (LIFT_ABOVE if self._capped else CAP_BELOW) * full
        self._capped = not lifted
        return self._limits.at(threads, None if lifted else rate)
