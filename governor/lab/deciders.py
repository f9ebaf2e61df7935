"""The deciders an experiment runs: the real policy core on the device's ladder, or the ungoverned baseline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import policies
from governor.lab.device import DeviceSpec
from governor.loop import Decider
from policies import Governor, ModelFootprint, Policy
from policies.decision import Decision, EngineConfig, Hold, State
from policies.ladder import ModelLadder, ModelTier
from sensors.snapshot import EngineObservation, Snapshot

NONE = "none"


class Ungoverned:
    """The baseline `none`: a policy that always asks for the full configuration; only the kernel throttles.

    Full means what llama.cpp does by default: every core, the largest model at its largest context, f16 KV.
    """

    def __init__(self, device: DeviceSpec, interval_s: float = 1.0) -> None:
        top = device.engine.model[0]
        self.config = EngineConfig(threads=device.cpu.cores, n_ctx=top.n_ctx, kv_type=top.kv_type, model=top.name)
        self._interval_s = interval_s

    def decide(
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, holds: Sequence[Hold] = ()
    ) -> Decision:
        del snapshot, engine, holds
        return Decision(
            t=t,
            state=State.SUSTAINED,
            engine=self.config,
            reason="ungoverned: full settings; only the kernel throttles",
            rule="none.full",
        )

    def interval_s(self, decision: Decision) -> float:
        del decision
        return self._interval_s


def ladder_of(device: DeviceSpec) -> ModelLadder:
    """The device's models as the policy sees a ladder (no files: the footprints come from the device file)."""
    tiers = tuple(
        ModelTier(name=m.name, path=Path(f"{m.name}.gguf"), n_ctx=m.n_ctx, kv_type=m.kv_type)
        for m in device.engine.model
    )
    return ModelLadder(tier=tiers)


def footprints_of(device: DeviceSpec) -> dict[str, ModelFootprint]:
    return {m.name: m.footprint() for m in device.engine.model}


def load_policy(name_or_file: str) -> Policy | None:
    """A policy by shipped name or file; None for the ungoverned baseline `none`."""
    if name_or_file == NONE:
        return None
    return policies.load_policy(name_or_file)


def decider_for(policy: Policy | None, device: DeviceSpec) -> Decider:
    if policy is None:
        return Ungoverned(device)
    return Governor(policy, ladder=ladder_of(device), footprints=footprints_of(device))
