"""The state machine: readings + time in, a Decision out. Pure: no I/O, no clock; all state lives in the object.

One tick: read the control temperature, forecast it, update the debounced conditions, pick the highest-priority
active state, gate the change by the dwell times (safer = fast, back = slow), then compose the engine config as the
minimum of every profile in force (the activity or pinned profile, low battery, hot's PI output, critical), apply
hold caps, let threads rise only one step per `recover_step_s`, and fit context / KV / model into memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import NamedTuple

from policies.allocator import PowerAllocator
from policies.authority import Authority
from policies.changecost import Dwell, Price, Rates, price
from policies.contention import ThreadFit, ThreadsNote
from policies.controller import PIController
from policies.cores import Cores
from policies.decision import PRIORITY, THREADS_MAX, Decision, EngineConfig, Hold, KvType, Outlook, State
from policies.explain import Tick, explain, rule_of
from policies.filters import BusyWindow, Forecast, Trigger
from policies.ladder import ModelLadder
from policies.loader import PolicyError
from policies.memfit import MIB, Candidate, Fit, ModelFootprint
from policies.memplan import MemoryPlan
from policies.readings import Sense, ZoneFilter
from policies.schema import KV_ORDER, MODEL_LARGEST, MODEL_SMALLEST, Policy, Power, Profile, all_of
from sensors.snapshot import Cpu, EngineObservation, Snapshot

RANK = {s: i for i, s in enumerate(PRIORITY)}  # 0 = safest
MITIGATING = frozenset({State.HOT, State.CRITICAL})
ACTIVITY = frozenset({State.IDLE, State.SUSTAINED})
NEAR_TRIP_C = 0.5  # this close to the binding zone's trip a cut in power is urgent (pays any price)
URGENT_CUT = 0.25  # over the PI's setpoint, a cut of the rate cap by this share (or a thread) pays any price
NEAR_TRIP_CUT = 0.1  # ... and this near the trip
DECODE_PRIOR_TOK_S = 5.0  # the price's decode rate before the engine has reported one
CONFIGS_KEPT = 256  # distinct engine configs remembered (the hot allocator's rate cap can take many values)
MODEL_ORDER = {MODEL_LARGEST: 0, MODEL_SMALLEST: 2}  # without a ladder: "smallest" beats a name beats "largest"


class Limits(NamedTuple):
    """A profile as the tick uses it: plain values, cheap to copy (a pydantic copy per tick would dominate)."""

    state: State
    threads: int
    n_ctx: int
    kv_rank: int
    model: str
    rate: float | None

    @classmethod
    def of(cls, state: State, p: Profile) -> Limits:
        return cls(state, p.thread_limit, p.n_ctx, KV_ORDER.index(p.kv_type), p.model, p.max_tokens_per_s)

    def at(self, threads: int, rate: float | None) -> Limits:
        """This profile with other threads and rate cap (`_replace`, at a third of its cost)."""
        return Limits(self.state, threads, self.n_ctx, self.kv_rank, self.model, rate)


class StateMachine:
    def __init__(
        self,
        policy: Policy,
        *,
        ladder: ModelLadder | None = None,
        footprints: Mapping[str, ModelFootprint] | None = None,
        freq_ratios: Sequence[float] | None = None,
        prior: Power | None = None,
    ) -> None:
        """`freq_ratios`: the CPU clock caps the daemon can write (shares of the maximum); None: none writable.
        `prior`: the device model's starting point (a `governor bench-device` file's), else the policy's `[power]`."""
        self.policy = policy
        self.ladder = ladder
        self.footprints = dict(footprints or {})
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
        self._fit_threads = ThreadFit(policy.contention)
        self.state = State.IDLE
        self.entered_t: float | None = None
        self.last: Decision | None = None
        self._pi: PIController | None = None
        self._pi_u: float | None = None
        self._cpus: int | None = None  # online CPUs at this tick (None: unknown)
        self._prefill = False  # the engine is busy with a prompt (no tokens yet): compute-bound
        self._contended = False  # other processes hold cores (the device model learns nothing then)
        self._threads_t = -math.inf  # when threads last changed (recovery steps count from there)
        self.memory = MemoryPlan(mem, policy.timing, adapters=bool(ladder is not None and ladder.adapters))
        self._pressure_cap: int | None = None  # n_ctx, without a ladder (with one: MemoryPlan)
        self._shrink_t = -math.inf
        self._lmkd = False
        # The change gate (policies/changecost.py): when the live settings and the reload settings last changed
        self._live_t = self._reload_t = self._model_t = -math.inf
        self._decode_tok_s: float | None = None  # the engine's last decode rate (the price's prefill prior)
        self._waiting = False  # the last decision stopped the engine (nothing runs without a kill)
        self._cores_key: tuple[object, ...] | None = None  # the clusters the device model's cores were built from
        ch = policy.changes
        self._dwell = Dwell(ch.live_dwell_s, ch.amortize, ch.model_dwell_s)
        self._configs: dict[tuple[object, ...], EngineConfig] = {}
        self._ramping = False
        self._untrusted_since: float | None = None  # since when trusted zones give no plausible reading
        self._calm = False
        self._tier_index = self._resolve_tiers()
        self._limits = {state: Limits.of(state, profile) for state, profile in policy.states.items()}
        self.power = PowerAllocator(policy, freq_ratios, prior, self.footprints)
        self.authority = Authority()  # hot steps aside where the heat is not the engine's (policies/authority.py)

    # -- set-up (validation of the policy against the ladder happens once, here) --------------------------------

    def _resolve_tiers(self) -> dict[State, int]:
        if self.ladder is None:
            return {}
        names = [t.name for t in self.ladder.tiers]
        index: dict[State, int] = {}
        for state, profile in self.policy.states.items():
            if profile.model == MODEL_LARGEST:
                index[state] = 0
            elif profile.model == MODEL_SMALLEST:
                index[state] = len(names) - 1
            elif profile.model in names:
                index[state] = names.index(profile.model)
            else:
                raise PolicyError(
                    self.policy.name, None, f"states.{state.value}.model", f"no tier {profile.model!r} in {names}"
                )
        return index

    # -- the tick ----------------------------------------------------------------------------------------------

    def decide(  # noqa: PLR0915 (one tick, read top to bottom)
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, holds: Sequence[Hold] = ()
    ) -> Decision:
        margin: float | None = None
        if self.power.enabled:  # the clock's fine steps let the setpoint sit closer to the trip
            power = self.policy.power
            margin = power.throttled_margin_c if snapshot.cpu.throttled else power.control_margin_c
        sense = self._sense(snapshot, engine, t, margin)
        self._lmkd = bool(snapshot.memory.lmkd)
        if engine is not None and engine.tokens_per_s:
            self._decode_tok_s = engine.tokens_per_s
        desired = State.IDLE
        for s in PRIORITY:  # the safest state whose condition is on (a plain loop: every tick)
            trigger = self.triggers.get(s)
            if trigger is not None and trigger.on:
                desired = s
                break
        previous_state = self.state
        held_for = self._gate(desired, t)

        live = [h for h in holds if h.expires_t is None or h.expires_t > t] if holds else []
        pins = [h.state for h in live if h.state is not None] if live else []
        pin = min(pins, key=RANK.__getitem__) if pins else None
        label = self.state if (pin is None or self.state in MITIGATING) else pin
        prev = self.last.engine if self.last is not None else None
        self._contended = self._fit_threads.contended(snapshot.cpu)
        if prev is not None:
            self.power.context(engine, prev.kv_type)
        if prev is not None and not self._contended:  # the device model is of the device alone
            rate_cap, freq = prev.max_tokens_per_s, snapshot.cpu.freq_ratio
            self.power.observe(prev.threads, rate_cap, freq, engine, battery=sense.battery, on_power=sense.on_power)
        self.power.choice, self._cpus = None, snapshot.cpu.count
        self._set_cores(snapshot.cpu)
        self._prefill = engine is not None and engine.busy and not engine.tokens_per_s  # a prompt: no tokens yet
        self._fit_threads.update(snapshot.cpu, engine, prev is not None and prev.max_tokens_per_s is not None, t)
        active = self._in_force(pin, sense, prev, t)
        caps, rate_caps, sizing = [], [], []  # by the holds in force (usually none)
        if live:
            caps = [h.max_threads for h in live if h.max_threads is not None]
            rate_caps = [h.max_tokens_per_s for h in live if h.max_tokens_per_s is not None]
            sizing = [h for h in live if h.max_tier is not None or h.max_ctx is not None]  # e.g. after a memory kill
        # Never more threads than online CPUs: llama.cpp's threads wait for each other at every step, so an
        # oversubscribed core slows them all (a 4-thread profile on a 2-core box). Unknown count: "all" is 4.
        # On cores of different speed, the count at or under that with the most speed (policies/cores.py).
        cores = self.power.model.cores
        allowed = all_of(min([lim.threads for lim in active] + caps), snapshot.cpu.count)
        threads = cores.best(allowed)
        # ... and none on cores other processes hold, unless fewer measured faster (policies/contention.py); where
        # the cores' speeds chose fewer than the engine would run ungoverned, and nothing asked for a loss, that count
        # is measured against it now and then: governing never loses to nothing (`ungoverned`).
        asked = bool(caps or rate_caps) or self.state not in ACTIVITY or pin is not None
        ungoverned = None if asked or allowed >= THREADS_MAX else allowed
        threads, contention = self._fit_threads.limit(threads, t, ungoverned=ungoverned)
        if contention is None or (contention.measured is None and contention.probe is None):
            threads = cores.best(threads)  # measured (or being measured) counts stand as they are
        rates = [lim.rate for lim in active if lim.rate is not None] + rate_caps
        rate = min(rates) if rates else None
        measured = contention is not None and (contention.measured is not None or contention.probe is not None)
        if measured:
            self._ramping = False
        else:
            threads, rate = self._recover(threads, rate, prev, t)
        freq = self.power.freq_now(t, self.policy.timing.recover_step_s)
        n_ctx = min([lim.n_ctx for lim in active] + [h.max_ctx for h in sizing if h.max_ctx is not None])
        kv: KvType = KV_ORDER[max(lim.kv_rank for lim in active)]
        tiers = [h.max_tier for h in sizing if h.max_tier is not None]
        model, n_ctx, kv, fitted = self._fit(
            active, n_ctx=n_ctx, kv=kv, sense=sense, engine=engine, prev=prev, t=t, max_tiers=tiers
        )
        n_batch = fitted.n_batch if fitted is not None and fitted.n_batch else self.policy.memory.n_batch
        config = self._config(
            threads, n_ctx, kv=kv, model=model, rate=rate, n_batch=n_batch, pool=self._pool_mib(fitted)
        )
        urgent = self._urgency(
            prev, config, snapshot=snapshot, sense=sense, previous_state=previous_state, contention=contention,
            capped=bool(caps or rate_caps), sized=bool(sizing), fitted=fitted,
        )  # fmt: skip
        config, declined = self._admit(prev, config, urgent=urgent, engine=engine, t=t)
        self._waiting = fitted is not None and fitted.wait is not None

        tick = Tick(
            t=t, policy=self.policy, sense=sense, previous_state=previous_state, state=self.state, label=label,
            desired=desired, held_for_s=held_for, prev=prev, config=config, pi_u=self._pi_u, fit=fitted,
            ramping=self._ramping, engine=engine, capped=bool(caps or rate_caps or sizing), choice=self.power.choice,
            contention=contention, load=self._fit_threads.readings(), declined=declined,
            aside_s=self.authority.back_after_s if self.state == State.HOT else None,
            sized_by=tuple(h.owner for h in sizing if model == h.max_tier or n_ctx == h.max_ctx),
        )  # fmt: skip
        self._calm = self._is_calm(sense, engine, label)
        fired, clause = rule_of(tick)
        decision = Decision.explained_by(
            partial(explain, tick, fired, clause),
            t=t, state=label, engine=config, rule=fired, changed=config is not prev and config != prev,
            freq_ratio=freq, engine_wait=None if fitted is None else fitted.wait, outlook=Outlook(
                None if sense.forecast_c is None else round(sense.forecast_c, 2), sense.view.hot_enter_c,
                sense.battery.percent if sense.battery is not None else None,
                sense.on_power if sense.battery is not None else None,
            ), affinity=self._placement(config),
        )  # fmt: skip
        self.last = decision
        return decision

    def _config(
        self, threads: int, n_ctx: int, *, kv: KvType, model: str, rate: float | None, n_batch: int, pool: float = 0.0
    ) -> EngineConfig:
        """The engine config of these values: one frozen object per distinct set (it changes a few times an hour,
        and building one is a tenth of a tick). Values come from validated profiles and holds: no re-validation."""
        key = (threads, n_ctx, kv, model, rate, type(rate), n_batch, pool)  # the type: 5 == 5.0, but "5" != "5.0"
        config = self._configs.get(key)
        if config is None:
            if len(self._configs) >= CONFIGS_KEPT:
                self._configs.clear()
            config = self._configs[key] = EngineConfig.model_construct(
                threads=threads,
                n_ctx=n_ctx,
                kv_type=kv,
                model=model,
                max_tokens_per_s=rate,
                n_batch=n_batch,
                lora_pool_mib=pool,
            )
        return config

    def _pool_mib(self, fitted: Fit | None) -> float:
        """The LoRA adapter pool: none without adapters in the ladder; the fit's (memory shrinks it first), else
        the policy's."""
        if self.ladder is None or not self.ladder.adapters:
            return 0.0
        if fitted is None:
            return self.policy.memory.lora_pool_mib
        return fitted.pool_bytes / MIB

    def _sense(
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, control_margin_c: float | None = None
    ) -> Sense:
        """Readings, then every debounced condition. Each raw condition uses its entry test while off and its laxer
        stay test while on (hysteresis); an unknown reading keeps a condition as it was."""
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
        trig[State.CRITICAL].update(crit_thermal or crit_battery or crit_memory or given_up is not None, t)
        trig[State.HOT].update(hot_raw, t)
        trig[State.LOW_BATTERY].update(low_raw, t)
        trig[State.SUSTAINED].update(sus_raw, t)
        return Sense(
            view=view, forecast_c=forecast, busy=busy, battery=battery, on_power=on_power, available=available,
            psi=psi, pressure=pressure, crit_thermal=crit_thermal, crit_battery=crit_battery, crit_memory=crit_memory,
            cpu_throttled=snapshot.cpu.throttled, untrusted=untrusted, given_up=given_up,
        )  # fmt: skip

    def _gate(self, desired: State, t: float) -> float:
        """Move to `desired` if the dwell allows (safer: min_dwell, critical: at once; back: recover_dwell).
        Returns how long a wanted change still has to wait (0 if none)."""
        timing = self.policy.timing
        if self.entered_t is None:
            self.state, self.entered_t = desired, t
            return 0.0
        if desired == self.state:
            return 0.0
        if RANK[desired] < RANK[self.state]:
            need = 0.0 if desired == State.CRITICAL else timing.min_dwell_s
        else:
            need = max(timing.min_dwell_s, timing.recover_dwell_s)
        since = t - self.entered_t
        if since >= need:
            if RANK[desired] > RANK[self.state]:
                self._threads_t = t  # the first step back up comes a full recover step after leaving
            self.state, self.entered_t = desired, t
            return 0.0
        return need - since

    def _in_force(self, pin: State | None, sense: Sense, prev: EngineConfig | None, t: float) -> list[Limits]:
        """Every profile that limits the engine now; the config is their minimum, so more heat only adds limits."""
        limits, trig = self._limits, self.triggers
        if pin is not None:
            activity = pin
        elif self.state in ACTIVITY:
            activity = self.state
        else:
            activity = State.SUSTAINED if trig[State.SUSTAINED].on else State.IDLE
        active = [limits[activity]]
        if pin is None and (self.state == State.LOW_BATTERY or trig[State.LOW_BATTERY].on):
            active.append(limits[State.LOW_BATTERY])  # a client's pin overrides low battery, never hot or critical
        view = sense.view
        hot = self.state == State.HOT
        aside = self.authority.aside(t, hot=hot, u=self._pi_u, throttled=sense.cpu_throttled, temp_c=view.temp_c)
        if hot and sense.untrusted and view.temp_c is None:
            # No temperature to control on: the hot profile at its floor (threads, rate and clock as low as hot
            # goes), not the PI's last output (at start: the sustained profile, as if nothing were wrong). The PI
            # starts again, bumpless from these limits, once a zone reads.
            self._pi, self._pi_u = None, None
            active.append(self._hot_at(0.0))
            if self.power.enabled:
                choice = self.power.allocate(0.0, self._cpus)
                active.append(self._limits[State.HOT].at(choice.threads, choice.rate))
        elif hot and aside:  # the kernel throttles with hot's cut at its floor: pass-through; the PI restarts bumpless
            self._pi, self._pi_u = None, None
        elif hot:
            u = self._pi_output(view.setpoint_c, view.hot_exit_c, view.temp_c, prev, t)
            if not self.power.enabled:
                active.append(self._hot_at(u))
            else:  # a power budget, allocated to clock x threads x rate
                if self._prefill and view.temp_c is not None and view.temp_c < view.setpoint_c:
                    # A prompt under the setpoint gets the whole budget, as `none` runs it: it is compute-bound (each
                    # clock step costs time to first token) and short, and where decode is memory-bound the clock it
                    # needs is lower; the PI's approach to the setpoint would cut it. The guard still keeps the trip.
                    u = 1.0
                guarded = self.power.guard(u, view.temp_c, view.trip_c, prev.threads if prev else None, self._cpus)
                if guarded < u and self._pi is not None and view.temp_c is not None:
                    # Back-calculation: the PI goes on from the budget in force, not from the one the guard overrode.
                    self._pi.start(view.setpoint_c, view.temp_c, guarded, t)
                    self._pi_u = u = guarded
                choice = self.power.allocate(u, self._cpus, prefill=self._prefill, contended=self._contended)
                active.append(self._limits[State.HOT].at(choice.threads, choice.rate))
        else:
            self._pi, self._pi_u = None, None
            if self.state == State.CRITICAL and self._memory_only(sense):
                # Out of memory and nothing else: the critical profile's memory (smallest tier, context, KV), not its
                # CPU limits; one thread at 1 tok/s frees no memory and loses every token it could have made.
                crit = limits[State.CRITICAL]
                active.append(crit.at(THREADS_MAX, None))
            elif self.state == State.CRITICAL:
                active += [limits[State.CRITICAL], self._hot_at(0.0)]
                if self.power.enabled:
                    self.power.allocate(0.0, self._cpus)
        return active

    def _recover(
        self, threads: int, rate: float | None, prev: EngineConfig | None, t: float
    ) -> tuple[int, float | None]:
        """Going down is immediate; threads rise one step per recover_step_s; the rate cap lifts once they are back."""
        target = threads
        if prev is not None and threads > prev.threads:
            threads = prev.threads + 1 if t - self._threads_t >= self.policy.timing.recover_step_s else prev.threads
            if self.state != State.HOT and threads < target and prev.max_tokens_per_s is not None:
                rate = prev.max_tokens_per_s if rate is None else min(rate, prev.max_tokens_per_s)
        self._ramping = threads < target
        return threads, rate

    def _outgrown(self, config: EngineConfig) -> bool:
        """`config` no longer fits the memory budget (the exit band) or would meet the killer: the shrink is urgent.
        Growing is what waits for its price."""
        fp = self.footprints.get(config.model)
        if fp is None:  # no ladder: memory pressure's cap on the context is all there is
            return self._pressure_cap is not None and config.n_ctx > self._pressure_cap
        size = fp.total_bytes(config.n_ctx, config.kv_type, self.policy.memory, config.n_batch)
        return (self.memory.budget is not None and size > self.memory.budget) or self._kills(config)

    def _set_cores(self, cpu: Cpu) -> None:
        key = (cpu.clusters, cpu.count)
        if key != self._cores_key:
            self._cores_key = key
            self.power.model.set_cores(Cores(cpu.clusters, cpu.count))

    def _placement(self, config: EngineConfig) -> tuple[int, ...] | None:
        """The CPUs for the threads: the fastest cores for their count; None where every core is alike."""
        cores = self.power.model.cores
        return None if cores.alike else cores.cpus(config.threads)

    def _memory_only(self, sense: Sense) -> bool:
        """Critical for the memory floor alone (no heat, no battery, no given-up engine)."""
        return sense.crit_memory and not (sense.crit_thermal or sense.crit_battery or sense.given_up is not None)

    def _smaller(self, config: EngineConfig, prev: EngineConfig) -> bool:
        fp, old = self.footprints.get(config.model), self.footprints.get(prev.model)
        if fp is None or old is None:
            return config.n_ctx < prev.n_ctx
        mem = self.policy.memory
        size = fp.total_bytes(config.n_ctx, config.kv_type, mem, config.n_batch)
        return size < old.total_bytes(prev.n_ctx, prev.kv_type, mem, prev.n_batch)

    def _kills(self, config: EngineConfig) -> bool:
        """Running `config` now would meet the killer (MemoryPlan.kill_predicted)."""
        fp = self.footprints.get(config.model)
        if fp is None:
            return False
        pool = config.lora_pool_mib * MIB  # the LoRA pool it holds (0 without adapters)
        size = fp.total_bytes(config.n_ctx, config.kv_type, self.policy.memory, config.n_batch) + pool
        fit = Fit(config.model, config.n_ctx, config.kv_type, size, "applied", n_batch=config.n_batch, pool_bytes=pool)
        return self.memory.kill_predicted(fit, [Candidate(config.model, fp, config.n_ctx, True)], lmkd=self._lmkd)

    def _price(self, prev: EngineConfig, want: EngineConfig, engine: EngineObservation | None) -> Price:
        ch = self.policy.changes
        decode = self._decode_tok_s or DECODE_PRIOR_TOK_S
        rates = Rates(prefill_tok_s=decode * ch.prefill_ratio, load_mb_s=ch.load_mb_s, context_s=ch.context_s)
        fill = engine.context_tokens if engine is not None and engine.context_tokens is not None else 0
        weights = {name: float(fp.file_bytes) for name, fp in self.footprints.items()}
        return price(prev, want, context_tokens=fill, rates=rates, weights_bytes=weights)

    def _urgency(
        self, prev: EngineConfig | None, config: EngineConfig, *, snapshot: Snapshot, sense: Sense,
        previous_state: State, contention: ThreadsNote | None, capped: bool, sized: bool, fitted: Fit | None,
    ) -> tuple[bool, bool]:  # fmt: skip
        """(the live settings' change is urgent, the reload settings' change is urgent): urgent changes pay any price.
        Critical, a safer state, a client's hold; for threads and the rate cap, a cut near the trip, beside a process
        that took a core, or below the CPUs online; for context, KV and model, a setting that outgrew the memory
        budget, or a stop or a start."""
        if prev is None or config == prev:
            return True, True
        crit = self.state == State.CRITICAL or sense.crit_memory
        escalated = RANK[self.state] < RANK[previous_state]  # a safer state: its cuts at once, not a pending growth
        view, temp = sense.view, sense.view.temp_c
        fewer = config.threads < prev.threads
        old_rate, new_rate = prev.max_tokens_per_s or math.inf, config.max_tokens_per_s or math.inf
        cut = fewer or new_rate <= (1 - URGENT_CUT) * old_rate  # a real cut, not the PI's next decimal
        step = fewer or new_rate <= (1 - NEAR_TRIP_CUT) * old_rate
        near_trip = temp is not None and temp >= view.trip_c - NEAR_TRIP_C
        over_setpoint = temp is not None and temp >= view.setpoint_c
        overcommit = snapshot.cpu.count is not None and prev.threads > snapshot.cpu.count
        live = (
            crit
            or (escalated and (fewer or new_rate < old_rate))
            or capped
            or (step and near_trip)
            or (cut and over_setpoint)
            or (fewer and (contention is not None or overcommit))
            or (contention is not None and contention.probe is not None)  # a probe is short and bounded ...
            or (fewer and self._fit_threads.returning)  # ... and so is coming back from it
        )
        stop_start = fitted is not None and (fitted.wait is not None or self._waiting)
        reload = crit or sized or stop_start or self._outgrown(prev) or (escalated and self._smaller(config, prev))
        return live, reload

    def _admit(
        self, prev: EngineConfig | None, want: EngineConfig, *, urgent: tuple[bool, bool],
        engine: EngineObservation | None, t: float,
    ) -> tuple[EngineConfig, str | None]:  # fmt: skip
        """Every change has a price: a change that is not urgent waits until the setting in force has lasted long
        enough to pay for it (policies/changecost.py). Returns the config to apply and, when part of the wanted
        change waits, what waits and why (for the reason)."""
        if prev is None or want == prev or not self.policy.changes.enabled:
            return self._applied(prev, want, t), None
        live_urgent, reload_urgent = urgent
        declined = []
        reload = (want.n_ctx, want.kv_type, want.model, want.n_batch)
        if prev.needs_reload(want) and not reload_urgent:
            p = self._price(prev, want, engine)
            need = self._dwell.needed(p) - (t - self._reload_t)
            if want.model != prev.model:
                need = max(need, self._dwell.model_s - (t - self._model_t))
            if need > 0:
                reload = (prev.n_ctx, prev.kv_type, prev.model, prev.n_batch)
                kept = {"n_ctx": prev.n_ctx, "kv_type": prev.kv_type, "model": prev.model, "n_batch": prev.n_batch}
                change = want.describe(want.model_copy(update=kept))
                declined.append(f"{change} waits {need:.0f} s: it would cost {p.text}")
        live = (want.threads, want.max_tokens_per_s)
        if live != (prev.threads, prev.max_tokens_per_s) and not live_urgent:
            need = self._dwell.live_s - (t - self._live_t)
            if need > 0:
                kept_live: dict[str, object] = {"threads": prev.threads, "max_tokens_per_s": prev.max_tokens_per_s}
                change = want.describe(want.model_copy(update=kept_live))
                declined.append(f"{change} waits {need:.0f} s (at most one change per {self._dwell.live_s:g} s)")
                live = (prev.threads, prev.max_tokens_per_s)
        if not declined:
            return self._applied(prev, want, t), None
        n_ctx, kv, model, n_batch = reload
        pool = want.lora_pool_mib  # the pool resizes between answers: no price, no dwell (it was reset to 0 here)
        config = self._config(live[0], n_ctx, kv=kv, model=model, rate=live[1], n_batch=n_batch, pool=pool)
        return self._applied(prev, prev if config == prev else config, t), "; ".join(declined)

    def _applied(self, prev: EngineConfig | None, config: EngineConfig, t: float) -> EngineConfig:
        """Note when the settings changed (the dwells count from there)."""
        if prev is None or config.threads != prev.threads:
            self._threads_t = t  # recovery steps count from here
        if prev is not None and config == prev:
            return config
        self._live_t = t
        if prev is None or prev.needs_reload(config):
            self._reload_t = t
        if prev is None or prev.model != config.model:
            self._model_t = t
        return config

    def interval_s(self, decision: Decision) -> float:
        timing = self.policy.timing
        pending = self._ramping or self._fit_threads.pending or any(trig.pending for trig in self.triggers.values())
        if decision.state in MITIGATING or pending:
            return timing.mitigating_interval_s
        if self._calm and decision is self.last:
            return max(timing.calm_interval_s, timing.interval_s)
        return timing.interval_s

    def _is_calm(self, sense: Sense, engine: EngineObservation | None, label: State) -> bool:
        """Nothing to watch closely: the engine is known and idle (it tells the daemon when a request comes), no
        condition is on or pending, and every reading is a margin away from its threshold (thermald's slow poll)."""
        if label != State.IDLE or engine is None or engine.busy or self._ramping:
            return False
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

    # -- parts of the tick -------------------------------------------------------------------------------------

    def _pi_output(
        self, setpoint: float, switch_on: float, temp: float | None, prev: EngineConfig | None, t: float
    ) -> float:
        hot = self.policy.states[State.HOT]
        if self._pi is None:
            gains = self.policy.thermal.pi
            self._pi = PIController.with_defaults(setpoint, switch_on, gains.k_pu, gains.k_po, gains.k_i)
            low = hot.min_threads or 1
            span = self._hot_top() - low
            level = 1.0 if prev is None or span == 0 else min(1.0, max(0.0, (prev.threads - low) / span))
            if self.power.enabled and prev is not None:  # the budget starts at the power in use: bumpless
                level = self.power.level(prev.threads, self._cpus)
            self._pi.start(setpoint, temp if temp is not None else setpoint, level, t)
            self._pi_u = level
        if temp is not None:
            self._pi_u = self._pi.update(setpoint, temp, t)
        return self._pi_u if self._pi_u is not None else 1.0

    def _hot_at(self, u: float) -> Limits:
        """The hot profile with threads and rate cap placed at u in [0, 1] between its bounds (monotone in u)."""
        hot = self.policy.states[State.HOT]
        low = hot.min_threads or 1
        low_rate, top_rate = hot.rate_range
        top_rate = top_rate or 1.0  # validated present
        low_rate = low_rate or top_rate
        top = self._hot_top()
        return self._limits[State.HOT].at(
            low + math.floor(u * max(0, top - low) + 0.5), round(low_rate + u * (top_rate - low_rate), 1)
        )

    def _hot_top(self) -> int:
        """Hot's most threads on this CPU: its count, at most the CPUs online, the fastest such count on its cores."""
        return self.power.full_threads(self._cpus)

    def _fit(
        self,
        active: Sequence[Limits],
        *,
        n_ctx: int,
        kv: KvType,
        sense: Sense,
        engine: EngineObservation | None,
        prev: EngineConfig | None,
        t: float,
        max_tiers: Sequence[str] = (),
    ) -> tuple[str, int, KvType, Fit | None]:
        """Model tier, context and KV type: the largest the profiles and holds allow that fits the memory budget."""
        pressure, available = sense.pressure, sense.available
        mem = self.policy.memory
        if self.ladder is None:
            # Without a ladder the tiers have no order: "smallest" beats a name beats "largest", else the safest.
            model = max(active, key=lambda lim: (MODEL_ORDER.get(lim.model, 1), -RANK[lim.state])).model
            if not pressure:
                self._pressure_cap = None
            elif prev is not None and t - self._shrink_t >= mem.psi_step_s:
                self._pressure_cap = max(mem.min_ctx, prev.n_ctx // 2)
                self._shrink_t = t
            if self._pressure_cap is not None:
                n_ctx = min(n_ctx, int(self._pressure_cap))
            return model, n_ctx, kv, None

        names = [tier.name for tier in self.ladder.tiers]  # a tier the ladder does not have limits nothing
        start = max([self._tier_index[lim.state] for lim in active] + [names.index(n) for n in max_tiers if n in names])
        tiers = self.ladder.tiers[start:]
        candidates = [
            Candidate(tier.name, self.footprints[tier.name], tier.n_ctx, tier.flash_attn)
            for tier in tiers
            if tier.name in self.footprints
        ]
        if not candidates:
            return tiers[0].name, min(n_ctx, tiers[0].n_ctx), kv, None

        result = self.memory.plan(
            candidates, start=start, n_ctx=n_ctx, kv=kv, available=available, engine=engine, pressure=pressure,
            lmkd=self._lmkd, t=t,
        )  # fmt: skip
        if (
            prev is not None
            and result.model != prev.model
            and self.policy.changes.enabled
            and t - self._model_t < self._dwell.model_s
            and not self._kills(prev)
        ):
            # A model switch at most once per model_dwell_s unless a kill is predicted: the best the model in force
            # can do meanwhile.
            same = self.memory.within([c for c in candidates if c.name == prev.model], n_ctx=n_ctx, kv=kv)
            if same is not None:
                result = same
        return result.model, result.n_ctx, result.kv_type, result
