"""What fits in memory: the model tier, context and KV type of the tick, and the memory questions the state machine
asks of a setting (has it outgrown the budget, would it meet the killer, is it smaller than another).

With a model ladder the tiers are tried from the largest the profiles and holds allow, against the memory budget
(`MemoryPlan`, policies/memplan.py); without one, memory pressure halves the context a step at a time. The policy's
tier names are checked against the ladder once, here, when the state machine is built. Pure: all state lives in the
object.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from policies.decision import RANK, EngineConfig, KvType, State
from policies.ladder import ModelLadder
from policies.loader import PolicyError
from policies.memfit import MIB, Candidate, Fit, ModelFootprint
from policies.memplan import MemoryPlan
from policies.readings import Sense
from policies.schema import MODEL_LARGEST, MODEL_SMALLEST, Limits, Policy
from sensors.snapshot import EngineObservation

MODEL_ORDER = {MODEL_LARGEST: 0, MODEL_SMALLEST: 2}  # without a ladder: "smallest" beats a name beats "largest"


class Sizing:
    def __init__(
        self, policy: Policy, ladder: ModelLadder | None, footprints: Mapping[str, ModelFootprint] | None
    ) -> None:
        self.policy = policy
        self.ladder = ladder
        self.footprints = dict(footprints or {})
        mem = policy.memory
        switch_s = policy.changes.model_dwell_s if policy.changes.enabled else 0.0
        adapters = bool(ladder is not None and ladder.adapters)
        self.memory = MemoryPlan(mem, policy.timing, adapters=adapters, switch_s=switch_s)
        self.lmkd = False  # the device kills by a low-memory killer's levels (Android's lmkd), this tick
        self._pressure_cap: int | None = None  # n_ctx, without a ladder (with one: MemoryPlan)
        self._shrink_t = -math.inf
        self._tier_index = self._resolve_tiers()

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

    def fit(
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
        switch_waits: bool = False,
    ) -> tuple[str, int, KvType, Fit | None]:
        """Model tier, context and KV type: the largest the profiles and holds allow that fits the memory budget.
        `switch_waits`: a model switch must wait now (policies/changecost.py), unless a kill is predicted."""
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
            lmkd=self.lmkd, t=t,
        )  # fmt: skip
        if prev is not None and result.model != prev.model and switch_waits:
            # A model switch at most once per model_dwell_s unless a kill is predicted: the best the model in force
            # can do meanwhile (MemoryPlan.within: on the reserve too, while the whole of it fits before a kill).
            tier = [c for c in candidates if c.name == prev.model]
            same = self.memory.within(tier, n_ctx=n_ctx, kv=kv)
            if same is not None:
                result = same
            elif tier:
                result = replace(result, kill=self._kill(tier[0]))
        return result.model, result.n_ctx, result.kv_type, result

    def _kill(self, tier: Candidate) -> str | None:
        """Why even the smallest setting of `tier` (the model in force) would meet the killer now, or leave less than
        the memory floor (critical: the smallest tier at the next tick anyway); None when it would only re-read its
        weights from storage (a switch the dwell does not excuse)."""
        room = self.memory.room
        if room is None:
            return None
        smallest = self.memory.smallest([tier])
        if self.memory.kill_predicted(smallest, [tier], lmkd=self.lmkd):
            counted = self.memory.kill_bytes(smallest, [tier], lmkd=self.lmkd) / MIB
            return (
                f"switch within the model dwell: {tier.name} would be killed ({counted:.0f} MiB the killer counts,"
                f" {room / MIB:.0f} MiB left)"
            )
        floor = self.policy.memory.floor_mb * MIB
        if smallest.bytes > room - floor:  # kept, it runs into the floor (issue 27's fleet: 0.5 s later)
            return (
                f"switch within the model dwell: {tier.name} at its smallest ({smallest.bytes / MIB:.0f} MiB) would"
                f" leave less than the {floor / MIB:.0f} MiB memory floor ({room / MIB:.0f} MiB left)"
            )
        return None

    def pool_mib(self, fitted: Fit | None) -> float:
        """The LoRA adapter pool: none without adapters in the ladder; the fit's (memory shrinks it first), else
        the policy's."""
        if self.ladder is None or not self.ladder.adapters:
            return 0.0
        if fitted is None:
            return self.policy.memory.lora_pool_mib
        return fitted.pool_bytes / MIB

    def outgrown(self, config: EngineConfig) -> bool:
        """`config` no longer fits the memory budget (the exit band) or would meet the killer: the shrink is urgent.
        Growing is what waits for its price."""
        fp = self.footprints.get(config.model)
        if fp is None:  # no ladder: memory pressure's cap on the context is all there is
            return self._pressure_cap is not None and config.n_ctx > self._pressure_cap
        size = fp.total_bytes(config.n_ctx, config.kv_type, self.policy.memory, config.n_batch)
        return (self.memory.budget is not None and size > self.memory.budget) or self.kills(config)

    def smaller(self, config: EngineConfig, prev: EngineConfig) -> bool:
        fp, old = self.footprints.get(config.model), self.footprints.get(prev.model)
        if fp is None or old is None:
            return config.n_ctx < prev.n_ctx
        mem = self.policy.memory
        size = fp.total_bytes(config.n_ctx, config.kv_type, mem, config.n_batch)
        return size < old.total_bytes(prev.n_ctx, prev.kv_type, mem, prev.n_batch)

    def kills(self, config: EngineConfig) -> bool:
        """Running `config` now would meet the killer (MemoryPlan.kill_predicted)."""
        fp = self.footprints.get(config.model)
        if fp is None:
            return False
        pool = config.lora_pool_mib * MIB  # the LoRA pool it holds (0 without adapters)
        size = fp.total_bytes(config.n_ctx, config.kv_type, self.policy.memory, config.n_batch) + pool
        fit = Fit(config.model, config.n_ctx, config.kv_type, size, "applied", n_batch=config.n_batch, pool_bytes=pool)
        return self.memory.kill_predicted(fit, [Candidate(config.model, fp, config.n_ctx, True)], lmkd=self.lmkd)
