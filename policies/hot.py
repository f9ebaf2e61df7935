"""The hot state's limits on the engine: the kernel power_allocator's PI output placed between the hot profile's
bounds (threads and rate cap), or, where the clock can be capped, a power budget the allocator spends on clock x
threads x rate (policies/allocator.py), with the guard that keeps the trip.

The state machine (policies/machine.py) asks for these limits while the state is hot, and for the hot profile at its
floor in critical. The PI starts bumpless from the power in use, and again once a zone reads after none did; where
the heat is not the engine's, hot steps aside (`Authority`, policies/authority.py). Pure: all state lives in the
object.
"""

from __future__ import annotations

import math

from policies.allocator import CAP_BELOW, LIFT_ABOVE, PowerAllocator
from policies.authority import Authority
from policies.ceiling import Ceiling
from policies.controller import PIController
from policies.decision import EngineConfig, State
from policies.readings import ThermalView
from policies.schema import Limits, Policy


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

    def reset(self) -> None:
        """The PI starts again, bumpless, the next time."""
        self._pi, self.u = None, None

    def leave(self, t: float) -> None:
        """Not hot: the PI starts again next time, and a step aside's back-off starts over."""
        self.authority.aside(t, hot=False, u=self.u, throttled=None, temp_c=None)
        self.ceiling.leave()
        self.reset()

    def limits(
        self, view: ThermalView, *, untrusted: bool, throttled: bool | None, prev: EngineConfig | None, t: float,
        cpus: int | None, prefill: bool, contended: bool,
    ) -> list[Limits]:  # fmt: skip
        """The hot limits of this tick (`throttled`: the kernel holds the clock down; `prefill`: the engine evaluates a
        prompt; `contended`: others hold cores)."""
        # Where hot caps the clock, a zone under its trip is not held there by others: the kernel's step only waits
        # out its hysteresis, and takes no clock hot's floor has not (policies/authority.py).
        trip = view.trip_c if self.power.enabled else None
        aside = self.authority.aside(t, hot=True, u=self.u, throttled=throttled, temp_c=view.temp_c, trip_c=trip)
        over = view.temp_c is not None and view.temp_c >= view.setpoint_c
        self.ceiling.observe(t, prev.threads if prev is not None else None, over_setpoint=over)
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
        if aside:  # the kernel throttles with hot's cut at its floor: pass-through; the PI restarts bumpless
            self.reset()
            return out
        u = self._pi_output(view, prev, t, cpus)
        if not self.power.enabled:
            limits = self.at(u, cpus)
            if most is not None and limits.threads > most:  # the rate cap u places stays: one thread is no hotter
                limits = limits.at(most, limits.rate)
            out.append(limits)
            self.ceiling.asked(limits.threads)
            return out
        # a power budget, allocated to clock x threads x rate
        if prefill and view.temp_c is not None and view.temp_c < view.setpoint_c:
            # A prompt under the setpoint gets the whole budget, as `none` runs it: it is compute-bound (each
            # clock step costs time to first token) and short, and where decode is memory-bound the clock it
            # needs is lower; the PI's approach to the setpoint would cut it. The guard still keeps the trip.
            u = 1.0
        guarded = self.power.guard(u, view.temp_c, view.trip_c, prev.threads if prev else None, cpus)
        if guarded < u and self._pi is not None and view.temp_c is not None:
            # Back-calculation: the PI goes on from the budget in force, not from the one the guard overrode.
            self._pi.start(view.setpoint_c, view.temp_c, guarded, t)
            self.u = u = guarded
        choice = self.power.allocate(u, cpus, prefill=prefill, contended=contended)
        out.append(self._limits.at(choice.threads, choice.rate))
        return out

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
