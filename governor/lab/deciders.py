"""The deciders an experiment runs: the real policy core on the device's ladder, or the ungoverned baseline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import policies
from govbase.errors import GovernorError
from governor.lab.device import DeviceSpec
from governor.loop import Decider
from policies import ModelFootprint, Policy, StateMachine
from policies.decision import Decision, EngineConfig, Hold, State
from policies.ladder import LoraAdapter, ModelLadder, ModelTier
from sensors.snapshot import EngineObservation, Snapshot

NONE = "none"
CONSTANT = "constant"


class Ungoverned:
    """The baseline `none`: a policy that always asks for the full configuration; only the kernel throttles.

    Full means what llama.cpp does by default: every core, the largest model at its largest context, f16 KV.
    `constant:threads=N,freq=R` is the same with N threads and the clock capped at R (a hand-tuned setting).
    """

    def __init__(
        self, device: DeviceSpec, interval_s: float = 1.0, *, threads: int | None = None, freq: float | None = None
    ) -> None:
        top = device.engine.model[0]
        self.config = EngineConfig(
            threads=threads or device.cpu.cores, n_ctx=top.n_ctx, kv_type=top.kv_type, model=top.name
        )
        self.freq = freq
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
            freq_ratio=self.freq,
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
    base = device.engine.model[0].name
    adapters = tuple(LoraAdapter(name=a.name, path=Path(f"{a.name}.gguf"), base=base) for a in device.engine.adapter)
    return ModelLadder(tier=tiers, adapter=adapters)


def footprints_of(device: DeviceSpec) -> dict[str, ModelFootprint]:
    return {m.name: m.footprint() for m in device.engine.model}


def parse_constant(name: str) -> dict[str, float] | None:
    """`constant:threads=3,freq=0.8` -> {"threads": 3, "freq": 0.8}; None when `name` is not a constant setting."""
    if not name.startswith(CONSTANT + ":"):
        return None
    out: dict[str, float] = {}
    for item in name.split(":", 1)[1].split(","):
        key, _, value = item.partition("=")
        if key not in ("threads", "freq"):
            raise GovernorError(f"{name}: expected constant:threads=N,freq=R, got {key!r}")
        try:
            out[key] = float(value)
        except ValueError:
            raise GovernorError(f"{name}: {key} must be a number, got {value!r}") from None
    return out


def load_policy(name_or_file: str) -> Policy | None:
    """A policy by shipped name or file; None for the ungoverned baseline `none`."""
    if name_or_file == NONE:
        return None
    return policies.load_policy(name_or_file)


def load_run(name_or_file: str) -> Policy | str | None:
    """What `simulate --policy` names: a policy, `none` (None) or a constant setting (its name, checked)."""
    if parse_constant(name_or_file) is not None:
        return name_or_file
    return load_policy(name_or_file)


def decider_for(policy: Policy | str | None, device: DeviceSpec) -> Decider:
    if policy is None:
        return Ungoverned(device)
    if isinstance(policy, str):
        const = parse_constant(policy) or {}
        threads = int(const["threads"]) if "threads" in const else None
        return Ungoverned(device, threads=threads, freq=const.get("freq"))
    ratios = device.cpu.freq_steps if device.cpu.freq_writable else None
    return StateMachine(policy, ladder=ladder_of(device), footprints=footprints_of(device), freq_ratios=ratios)
