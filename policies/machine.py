"""The state machine: readings + time in, a Decision out. Pure: no I/O, no clock; all state lives in the object.

One tick: update the debounced conditions (policies/conditions.py), pick the highest-priority active state, gate the
change by the dwell times (safer = fast, back = slow), then compose the engine config as the minimum of every profile
in force (the activity or pinned profile, low battery, hot's limits (policies/hot.py), critical), apply hold caps,
let threads rise only one step per `recover_step_s`, fit context / KV / model into memory (policies/sizing.py), and
let through only the changes that are urgent or have paid their price (policies/changecost.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial

from policies.allocator import PowerAllocator
from policies.changecost import ChangeGate
from policies.conditions import Conditions
from policies.contention import ThreadFit, ThreadsNote
from policies.cores import Cores
from policies.decision import PRIORITY, RANK, THREADS_MAX, Decision, EngineConfig, Hold, KvType, Outlook, State
from policies.explain import Tick, explain, rule_of
from policies.hot import HotControl
from policies.ladder import ModelLadder
from policies.memfit import Fit, ModelFootprint
from policies.readings import Sense
from policies.schema import KV_ORDER, Limits, Policy, Power, all_of
from policies.sizing import Sizing
from policies.tierstep import TierStep
from sensors.snapshot import Cpu, EngineObservation, Snapshot

MITIGATING = frozenset({State.HOT, State.CRITICAL})
ACTIVITY = frozenset({State.IDLE, State.SUSTAINED})
NEAR_TRIP_C = 0.5  # this close to the binding zone's trip a cut in power is urgent (pays any price)
URGENT_CUT = 0.25  # over the PI's setpoint, a cut of the rate cap by this share (or a thread) pays any price
NEAR_TRIP_CUT = 0.1  # ... and this near the trip
RATE_STEP = 0.2  # in critical for memory alone, a thread or a rate cap step this large either way is urgent
CONFIGS_KEPT = 256  # distinct engine configs remembered (the hot allocator's rate cap can take many values)


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
        self.conditions = Conditions(policy)
        self.sizing = Sizing(policy, ladder, footprints)  # checks the policy's tiers against the ladder
        self.ladder, self.footprints = ladder, self.sizing.footprints
        self.gate = ChangeGate(policy.changes, self.footprints)
        self._fit_threads = ThreadFit(policy.contention)
        self.state = State.IDLE
        self.entered_t: float | None = None
        self.last: Decision | None = None
        self._cpus: int | None = None  # online CPUs at this tick (None: unknown)
        self._prefill = False  # the engine is busy with a prompt (no tokens yet): compute-bound
        self._contended = False  # other processes hold cores (the device model learns nothing then)
        self._threads_t = -math.inf  # when threads last changed (recovery steps count from there)
        self._waiting = False  # the last decision stopped the engine (nothing runs without a kill)
        self._cores_key: tuple[object, ...] | None = None  # the clusters the device model's cores were built from
        self._configs: dict[tuple[object, ...], EngineConfig] = {}
        self._ramping = False
        self._calm = False
        self._slow_placed = False  # the last decision placed the threads on the slowest cluster alone (hot's `slow`)
        self._slow_cpus = False  # ... and its affinity put them there (not a prompt under the setpoint)
        self._limits = {state: Limits.of(state, profile) for state, profile in policy.states.items()}
        self.power = PowerAllocator(policy, freq_ratios, prior, self.footprints)
        self.hot = HotControl(policy, self.power)
        weights = {name: float(fp.file_bytes) for name, fp in self.footprints.items()}
        self.tiers = TierStep([tier.name for tier in ladder.tiers], weights) if ladder is not None else None

    # -- the tick ----------------------------------------------------------------------------------------------

    def decide(  # noqa: PLR0915 (one tick, read top to bottom)
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, holds: Sequence[Hold] = ()
    ) -> Decision:
        margin: float | None = None
        if self.power.enabled:  # the clock's fine steps let the setpoint sit closer to the trip
            power = self.policy.power
            margin = power.throttled_margin_c if snapshot.cpu.throttled else power.control_margin_c
        sense = self.conditions.sense(snapshot, engine, t, margin)
        self.sizing.lmkd = bool(snapshot.memory.lmkd)
        if engine is not None and engine.tokens_per_s:
            self.gate.decode_tok_s = engine.tokens_per_s
        desired = State.IDLE
        for s in PRIORITY:  # the safest state whose condition is on (a plain loop: every tick)
            trigger = self.conditions.triggers.get(s)
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
            self.power.observe(
                prev.threads, rate_cap, freq, engine, battery=sense.battery, on_power=sense.on_power,
                slow=self._slow_cpus,
            )  # fmt: skip
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
        slow = self.hot.slow  # hot's threads on the slowest cluster alone: as many as asked, up to its cores
        best = (lambda n: min(n, len(cores.slow_cpus))) if slow else cores.best
        threads = best(allowed)
        # ... and none on cores other processes hold, unless fewer measured faster (policies/contention.py); where
        # the cores' speeds chose fewer than the engine would run ungoverned, and nothing asked for a loss, that count
        # is measured against it now and then: governing never loses to nothing (`ungoverned`).
        asked = bool(caps or rate_caps) or self.state not in ACTIVITY or pin is not None
        ungoverned = None if asked or allowed >= THREADS_MAX else allowed
        threads, contention = self._fit_threads.limit(threads, t, ungoverned=ungoverned)
        if contention is None or (contention.measured is None and contention.probe is None):
            threads = best(threads)  # measured (or being measured) counts stand as they are
        rates = [lim.rate for lim in active if lim.rate is not None] + rate_caps
        rate = min(rates) if rates else None
        measured = contention is not None and (contention.measured is not None or contention.probe is not None)
        moved = slow and not self._slow_placed
        if measured or moved or (self.state == State.HOT and self.hot.authority.back_after_s is not None):
            # measured counts, hot stepped aside (the engine as ungoverned), or threads moved to the slowest cores
            # (less power, not a rise): no ramp
            self._ramping = False
        else:
            threads, rate = self._recover(threads, rate, prev, t)
        freq = self.power.freq_now(t, self.policy.timing.recover_step_s)
        n_ctx = min([lim.n_ctx for lim in active] + [h.max_ctx for h in sizing if h.max_ctx is not None])
        kv: KvType = KV_ORDER[max(lim.kv_rank for lim in active)]
        tiers = [h.max_tier for h in sizing if h.max_tier is not None]
        stepped = self._tier_step(prev, engine, t)
        if stepped is not None:
            tiers.append(stepped)
        model, n_ctx, kv, fitted = self.sizing.fit(
            active,
            n_ctx=n_ctx,
            kv=kv,
            sense=sense,
            engine=engine,
            prev=prev,
            t=t,
            max_tiers=tiers,
            switch_waits=self.gate.model_waits(t),
        )
        n_batch = fitted.n_batch if fitted is not None and fitted.n_batch else self.policy.memory.n_batch
        config = self._config(
            threads, n_ctx, kv=kv, model=model, rate=rate, n_batch=n_batch, pool=self.sizing.pool_mib(fitted)
        )
        urgent = self._urgency(
            prev, config, snapshot=snapshot, sense=sense, previous_state=previous_state, contention=contention,
            capped=bool(caps or rate_caps), sized=bool(sizing) or self._tier_due(prev, model, stepped, t),
            fitted=fitted,
        )  # fmt: skip
        config, declined = self.gate.admit(prev, config, urgent=urgent, engine=engine, t=t, build=self._config)
        if prev is None or config.threads != prev.threads:
            self._threads_t = t  # recovery steps count from here
        if declined is None or config != prev:  # (a change that waits for its price stays where it was)
            self._slow_placed = slow
        # a prompt under the setpoint runs on the fastest cores, the same threads (no reconfiguration): it is
        # compute-bound and short, and on little cores its wait grew 3-fold (the shipped phone's android-termux)
        self._slow_cpus = self._slow_placed and not self.hot.prompt_fast
        self._waiting = fitted is not None and fitted.wait is not None

        tick = Tick(
            t=t, policy=self.policy, sense=sense, previous_state=previous_state, state=self.state, label=label,
            desired=desired, held_for_s=held_for, prev=prev, config=config, pi_u=self.hot.u, fit=fitted,
            ramping=self._ramping, engine=engine, capped=bool(caps or rate_caps or sizing), choice=self.power.choice,
            contention=contention, load=self._fit_threads.readings(), declined=declined,
            aside=self.hot.authority.note if self.state == State.HOT else None,
            ceiling=self.hot.ceiling.note(t) if self.state == State.HOT else None,
            slow=cores.slow_cpus if self._slow_cpus else (),
            saturated=self.state == State.HOT and self.hot.saturated,
            sized_by=tuple(h.owner for h in sizing if model == h.max_tier or n_ctx == h.max_ctx),
            tier=None if stepped is None or self.tiers is None else (stepped, self.tiers.share),
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
        limits, trig = self._limits, self.conditions.triggers
        if pin is not None:
            activity = pin
        elif self.state in ACTIVITY:
            activity = self.state
        else:
            activity = State.SUSTAINED if trig[State.SUSTAINED].on else State.IDLE
        active = [limits[activity]]
        if pin is None and (self.state == State.LOW_BATTERY or trig[State.LOW_BATTERY].on):
            active.append(limits[State.LOW_BATTERY])  # a client's pin overrides low battery, never hot or critical
        # In critical for memory alone the heat is still hot's to govern once the zone reaches the setpoint: its limits
        # apply as in hot (else the engine ran unlimited into the kernel's throttling: fleet:2:12's squeeze, 131 s)
        temp = sense.view.temp_c
        over = temp is not None and temp >= sense.view.setpoint_c
        memory_hot = self.state == State.CRITICAL and sense.memory_only and trig[State.HOT].on and over
        if self.state == State.HOT or memory_hot:
            active += self.hot.limits(
                sense.view, untrusted=sense.untrusted, throttled=sense.cpu_throttled, prev=prev, t=t, cpus=self._cpus,
                prefill=self._prefill, contended=self._contended, saturated=self._fit_threads.saturated,
                place=self.state == State.HOT, pressure=sense.pressure,
            )  # fmt: skip
        else:
            self.hot.leave(t)
            most = self.hot.ceiling.limit(t)  # a count hot cut again soon after rising to it waits here too
            if most is not None and self.state in ACTIVITY:
                active.append(limits[activity].at(most, None))
        if self.state == State.CRITICAL and sense.memory_only:
            # Out of memory and nothing else: the critical profile's memory (smallest tier, context, KV), not its
            # CPU limits; one thread at 1 tok/s frees no memory and loses every token it could have made.
            crit = limits[State.CRITICAL]
            active.append(crit.at(THREADS_MAX, None))
        elif self.state == State.CRITICAL:
            active += [limits[State.CRITICAL], self.hot.at(0.0, self._cpus)]
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

    def _tier_step(self, prev: EngineConfig | None, engine: EngineObservation | None, t: float) -> str | None:
        """Hot's largest tier where its budget leaves the tier in force far slower than the ungoverned engine
        (policies/tierstep.py; with a writable clock, judged while the engine decodes); at the smallest, hot yields."""
        steps = self.tiers
        if self.state != State.HOT:
            if steps is not None:
                steps.leave()
            return None
        decoding = engine is not None and engine.busy and bool(engine.tokens_per_s)  # idle, the zone cools: no news
        limit = steps.limit if steps is not None else None
        speeds = self.hot.against_kernel(self._cpus)
        if speeds is None or prev is None or not decoding or self.hot.authority.back_after_s:
            return limit
        governed, ungoverned = speeds
        if steps is not None:
            limit = steps.observe(t, prev.model, governed / ungoverned if ungoverned > 0 else 1.0)
        self.hot.losing(t, governed, ungoverned, tiers=steps, model=prev.model)
        return limit

    def _tier_due(self, prev: EngineConfig | None, model: str, stepped: str | None, t: float) -> bool:
        """Hot's step down to a smaller tier pays its price at once (it was held `HOLD_S` and buys several times the
        tokens), but not sooner than `model_dwell_s` after the last model switch."""
        due = stepped is not None and prev is not None and model == stepped != prev.model
        return due and not self.gate.switch_waits(t)

    def _set_cores(self, cpu: Cpu) -> None:
        key = (cpu.clusters, cpu.count)
        if key != self._cores_key:
            self._cores_key = key
            self.power.model.set_cores(Cores(cpu.clusters, cpu.count))

    def _placement(self, config: EngineConfig) -> tuple[int, ...] | None:
        """The CPUs for the threads: the fastest for their count, or hot's slowest cluster; None: all alike."""
        cores = self.power.model.cores
        return None if cores.alike else cores.cpus(config.threads, slow=self._slow_cpus)

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
        # critical for memory alone: the PI's next decimal waits the live dwell (fleet:2:181: 44 changes a minute)
        moved = config.threads != prev.threads or not (1 - RATE_STEP) * old_rate < new_rate < old_rate / (1 - RATE_STEP)
        crit_live = crit and (moved or not (sense.crit_memory and sense.memory_only))
        near_trip = temp is not None and temp >= view.trip_c - NEAR_TRIP_C
        over_setpoint = temp is not None and temp >= view.setpoint_c
        overcommit = snapshot.cpu.count is not None and prev.threads > snapshot.cpu.count
        live = (
            crit_live
            or (escalated and (fewer or new_rate < old_rate))
            or capped
            or (step and near_trip)
            or (cut and over_setpoint)
            or (fewer and (contention is not None or overcommit))
            or (contention is not None and contention.probe is not None)  # a probe is short and bounded ...
            or (fewer and self._fit_threads.returning)  # ... and so is coming back from it
        )
        stop_start = fitted is not None and (fitted.wait is not None or self._waiting)
        reload = (
            crit
            or sized
            or stop_start
            or self.sizing.outgrown(prev)
            or (escalated and self.sizing.smaller(config, prev))
        )
        return live, reload

    def interval_s(self, decision: Decision) -> float:
        timing = self.policy.timing
        pending = self._ramping or self._fit_threads.pending or self.conditions.pending
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
        return self.conditions.quiet(sense)
