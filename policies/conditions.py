"""The debounced conditions: readings + time in, which states' conditions are on (`Sense`) out.

Each raw condition (hot, critical, low battery, sustained use, memory pressure) uses its entry test while off and its
laxer stay test while on (hysteresis), then a `Trigger` debounces it; an unknown reading keeps a condition as it was.
The state machine (policies/machine.py) picks its state from these triggers. Pure: all state lives in the object.
"""

from __future__ import annotations

from policies.decision import State
from policies.filters import BusyWindow, Forecast, Trigger
from policies.memfit import MIB
from policies.readings import Sense, ZoneFilter
from policies.schema import Policy
from sensors.snapshot import EngineObservation, Snapshot


class Conditions:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        th, act, bat, crit, mem = policy.thermal, policy.activity, policy.battery, policy.critical, policy.memory
        self._zones = ZoneFilter(th)
        self._forecast = Forecast(
            th.forecast_window_s, th.forecast_horizon_s, th.forecast_min_points, th.forecast_max_rise_c
        )
        self._busy = BusyWindow(act.window_s)
        self.triggers: dict[State, Trigger] = {
            State.CRITICAL: Trigger(crit.enter_debounce_s, crit.exit_debounce_s),
            State.HOT: Trigger(th.enter_debounce_s, th.exit_debounce_s),
            State.LOW_BATTERY: Trigger(bat.enter_debounce_s, bat.exit_debounce_s),
            State.SUSTAINED: Trigger(act.enter_debounce_s, act.exit_debounce_s),
        }
        self._pressure = Trigger(0.0, mem.psi_exit_debounce_s)  # PSI avg10 is already a 10 s average
        self._untrusted_since: float | None = None  # since when trusted zones give no plausible reading
        self._memory_only = False  # critical's last cause was the memory floor alone

    def sense(
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, control_margin_c: float | None = None
    ) -> Sense:
        """Readings, then every debounced condition."""
        pol, trig = self.policy, self.triggers
        view = self._zones.view(snapshot, control_margin_c)
        temp = view.temp_c
        forecast: float | None = None
        if temp is not None:  # forecast on the scale that stays continuous when another zone starts to bind
            scaled = temp - view.scale_offset_c
            self._forecast.add(t, scaled)
            forecast = self._forecast.predict(scaled, self._forecast.slope()) + view.scale_offset_c
        crit_on = trig[State.CRITICAL].on
        if not view.untrusted:
            self._untrusted_since = None
        elif self._untrusted_since is None:
            self._untrusted_since = t
        untrusted = self._untrusted_since is not None and t - self._untrusted_since >= pol.thermal.untrusted_grace_s
        if temp is None or forecast is None:
            hot_raw, crit_thermal = trig[State.HOT].on or untrusted, False
        else:
            if trig[State.HOT].on:
                hot_raw = temp >= view.hot_exit_c or forecast >= view.hot_enter_c
            else:
                hot_raw = forecast >= view.hot_enter_c
            crit_temp = view.critical_temp_c if view.critical_temp_c is not None else temp
            crit_thermal = crit_temp >= (view.critical_exit_c if crit_on else view.critical_c)

        battery, bat = snapshot.battery, pol.battery
        percent = battery.percent if battery is not None else None
        on_power = battery is not None and (battery.plugged is True or battery.charging is True)
        if percent is None:
            low_raw, crit_battery = trig[State.LOW_BATTERY].on and battery is not None, False
        else:
            low_on = trig[State.LOW_BATTERY].on
            low_raw = not on_power and percent <= bat.low_percent + (bat.hysteresis_percent if low_on else 0)
            crit_battery = not on_power and percent <= bat.critical_percent + (bat.hysteresis_percent if crit_on else 0)

        mem = pol.memory
        available = snapshot.memory.available_bytes
        crit_memory = (
            available is not None and available < (mem.floor_mb + (mem.floor_hysteresis_mb if crit_on else 0)) * MIB
        )
        psi = snapshot.memory.psi_some_avg10
        psi_at = mem.psi_exit if self._pressure.on else mem.psi_enter
        pressure = self._pressure.update(psi is not None and psi >= psi_at, t)

        self._busy.add(t, engine is not None and engine.busy)
        busy = self._busy.fraction(t)
        act = pol.activity
        sus_raw = busy >= (act.exit_fraction if trig[State.SUSTAINED].on else act.enter_fraction)

        given_up = engine.given_up if engine is not None else None
        if given_up is not None:  # a fact the supervisor states, not a noisy reading: no debounce
            trig[State.CRITICAL].on, trig[State.CRITICAL].since = True, None
        self._critical(crit_thermal or crit_battery or given_up is not None, crit_memory, t)
        trig[State.HOT].update(hot_raw, t)
        trig[State.LOW_BATTERY].update(low_raw, t)
        trig[State.SUSTAINED].update(sus_raw, t)
        return Sense(
            view=view, forecast_c=forecast, busy=busy, battery=battery, on_power=on_power, available=available,
            psi=psi, pressure=pressure, crit_thermal=crit_thermal, crit_battery=crit_battery, crit_memory=crit_memory,
            cpu_throttled=snapshot.cpu.throttled, untrusted=untrusted, given_up=given_up, memory_only=self._memory_only,
        )  # fmt: skip

    def _critical(self, others: bool, memory: bool, t: float) -> None:
        """Critical's trigger, and what it is for: that stays through its dwell. Memory back, the critical profile's
        one thread at 1 tok/s and their one-a-step return lost what a memory-only critical kept (a phone's squeeze,
        fleet:1:8: 0.70 x `none`'s tokens)."""
        if memory or others:
            self._memory_only = not others
        self.triggers[State.CRITICAL].update(memory or others, t)

    @property
    def pending(self) -> bool:
        """A condition is changing but not yet debounced (the loop then ticks at its watchful interval)."""
        return any(trig.pending for trig in self.triggers.values())

    def quiet(self, sense: Sense) -> bool:
        """No condition is on or pending, and every reading is a margin away from its threshold (thermald's slow
        poll)."""
        if any(trig.on or trig.pending for trig in self.triggers.values()) or sense.pressure:
            return False
        timing, view = self.policy.timing, sense.view
        if view.temp_c is not None:
            far = view.hot_enter_c - timing.calm_margin_c
            if view.temp_c > far or (sense.forecast_c is not None and sense.forecast_c > far):
                return False
        percent = sense.battery.percent if sense.battery is not None else None
        if percent is not None and percent <= self.policy.battery.low_percent + timing.calm_battery_margin_percent:
            return False
        mem = self.policy.memory
        if sense.psi is not None and sense.psi >= mem.psi_exit:
            return False
        floor = (mem.floor_mb + 2 * mem.floor_hysteresis_mb) * MIB
        return sense.available is None or sense.available >= floor
