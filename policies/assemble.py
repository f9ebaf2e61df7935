"""Assembling a StateMachine from files: the only I/O the policy core needs, done once before the first tick."""

from __future__ import annotations

from pathlib import Path

from policies.ladder import ModelLadder, load_ladder
from policies.loader import load_policy
from policies.machine import StateMachine
from policies.memfit import ModelFootprint


def load_footprints(ladder: ModelLadder) -> dict[str, ModelFootprint]:
    """Each tier's memory footprint from its GGUF header (raises MemFitError naming the file)."""
    return {tier.name: ModelFootprint.from_gguf(tier.path) for tier in ladder.tiers}


def build_state_machine(policy: str | Path, models: Path | None = None) -> StateMachine:
    """A policy by name or file and, optionally, a model ladder TOML whose GGUF headers give the footprints."""
    loaded = load_policy(policy)
    if models is None:
        return StateMachine(loaded)
    ladder = load_ladder(models)
    return StateMachine(loaded, ladder=ladder, footprints=load_footprints(ladder))
