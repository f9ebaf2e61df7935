"""Policies: readings + time in, decision + reason out. Pure: no I/O and no clock of its own.

Public API: `load_policy`, `Policy`, `PolicyError`, `Governor`, `replay`, `read_trace`, `build_governor`,
`load_footprints`, `memfit` (`ModelFootprint.from_gguf`, `fit`), plus the shared types in `policies.decision`
and `policies.ladder`.
"""

from policies import memfit
from policies.assemble import build_governor, load_footprints
from policies.loader import PolicyError, load_policy, shipped_profiles
from policies.machine import Governor
from policies.memfit import ModelFootprint
from policies.replay import TraceError, read_trace, replay
from policies.schema import Policy

__all__ = [
    "Governor",
    "ModelFootprint",
    "Policy",
    "PolicyError",
    "TraceError",
    "build_governor",
    "load_footprints",
    "load_policy",
    "memfit",
    "read_trace",
    "replay",
    "shipped_profiles",
]
