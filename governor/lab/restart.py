"""What a change costs an engine that fixes its settings at start (llama.cpp's llama-server, EngineSpec.kind): the
rules governor.daemon.llamaserver follows, for the lab's simulated engine (which may not import the daemon)."""

from __future__ import annotations

from policies.decision import KNOBS, EngineConfig

LIVE = frozenset({"max_tokens_per_s"})  # paced on the public socket; everything else is fixed at start


def needed(old: EngineConfig, new: EngineConfig) -> bool:
    """Going from `old` to `new` restarts the server."""
    return any(getattr(old, name) != getattr(new, name) for name in KNOBS if name not in LIVE)


def restorable(old: EngineConfig, new: EngineConfig, tokens: float) -> bool:
    """llama.cpp loads the saved slot into the new server: the same model and KV type, and a context it fits in."""
    return (old.model, old.kv_type) == (new.model, new.kv_type) and tokens < new.n_ctx
