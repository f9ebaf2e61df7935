"""Policies: readings + time in, decision + reason out. Pure: no I/O and no clock of its own.

Public API: `load_policy`, `Policy`, `PolicyError`, `StateMachine`, `replay`, `read_trace`, `build_state_machine`,
`load_footprints`, `memfit` (`ModelFootprint.from_gguf`, `fit`), plus the shared types in `policies.decision`
and `policies.ladder`.
"""

from policies import memfit
from policies.assemble import build_state_machine, load_footprints
from policies.loader import PolicyError, load_policy, shipped_profiles
from policies.machine import StateMachine
from policies.memfit import ModelFootprint
from policies.replay import TraceError, read_trace, replay
from policies.schema import Policy

__all__ = [
    "ModelFootprint",
    "Policy",
    "PolicyError",
    "StateMachine",
    "TraceError",
    "build_state_machine",
    "load_footprints",
    "load_policy",
    "memfit",
    "read_trace",
    "replay",
    "shipped_profiles",
]
