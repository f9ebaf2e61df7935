"""The reconfiguration plan: how the engine goes from one config to another, as the real engine does it and as the
lab's simulated engine models it. Pure (no llama.cpp, no clock): both import this one module, so they cannot drift.

- `kind`: live between two tokens (threads, rate cap), or a new context: the same model and KV type (`resize`: the
  sequence's cache is copied into it when it fits, `cache_fits`), a new KV type (`new_cache`: the conversation is
  evaluated again), or another model (`new_model`: its weights are loaded too).
- `why_cold`: a `new_cache` change mid-answer is built warm beside the answering context (governor.engine.swap) when
  there are threads to split, the answer fits the new context and memory leaves `RESERVE_BYTES` free; else why not.
- `second_context_bytes`: what that second context adds (policies.memfit's arithmetic).
- `next_round`: the warm build's prefill, then up to `CATCH_UP_ROUNDS` rounds of the tokens the answer gained meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from governor.engine.chat import room_for_answer
from policies.decision import EngineConfig
from policies.memfit import MIB, MemFitError, ModelFootprint
from policies.schema import Memory

RESERVE_BYTES = Memory().reserve_mb * MIB  # left free for everything else, as the policy's memory fit does
CATCH_UP_ROUNDS = 4  # after the warm build's prefill, evaluations of the tokens the answer gained meanwhile

Kind = Literal["live", "resize", "new_cache", "new_model"]


def kind(old: EngineConfig, new: EngineConfig) -> Kind:
    """What going from `old` to `new` takes (the knobs' `live` flags say what a new context is needed for)."""
    if not old.needs_reload(new):
        return "live"
    if old.model != new.model:
        return "new_model"
    if old.kv_type != new.kv_type:
        return "new_cache"
    return "resize"


def cache_fits(tokens: float, n_ctx: int) -> bool:
    """Whether a sequence of `tokens` can be copied into a new context of `n_ctx` (else it is evaluated again)."""
    return tokens < n_ctx


def answer_room(n_ctx: int, tokens_left: int | None) -> int:
    """Context kept free for the rest of an answer that may still produce `tokens_left` (None: no limit)."""
    return room_for_answer(n_ctx, None if tokens_left is None else max(tokens_left, 1))


def second_context_bytes(footprint: ModelFootprint, target: EngineConfig, copied_bytes: float = 0.0) -> float:
    """What a second context of the same weights with `target` adds: its KV cache and compute buffer, plus the
    weights llama.cpp copied out of the mapped file (`copied_bytes`: repacked, CPU_REPACK / AMX; the lab models
    none)."""
    kv = footprint.kv_bytes(target.n_ctx, target.kv_type)
    return kv + footprint.compute_bytes(target.n_ctx, target.n_batch) + copied_bytes


def why_cold(
    old: EngineConfig,
    target: EngineConfig,
    *,
    threads: int,
    tokens: float,
    room: int,
    memory: Callable[[], tuple[float, float]],
) -> str | None:
    """None when `target` can be built warm beside the answering context of `old` (the answer's `tokens` so far plus
    `room` for the rest fit the new context), else why not. `memory()` gives (bytes the new context needs, bytes
    available) and is asked last; a MemFitError from it is the reason."""
    if kind(old, target) != "new_cache":
        return "not a KV type change of the same model"
    if threads < 2:
        return "one thread: nothing to split"
    if tokens + room > target.n_ctx:
        return "the answer does not fit the new context as it is"
    try:
        need, available = memory()
    except MemFitError as exc:
        return str(exc)
    if available - need < RESERVE_BYTES:
        return f"{need / MIB:.0f} MiB more would leave less than {RESERVE_BYTES / MIB:.0f} MiB of {available / MIB:.0f}"
    return None


def next_round(done: float, tokens: float, rounds: int) -> float | None:
    """The warm build's next goal (evaluate up to it) after `rounds` rounds that evaluated `done` of the answer's
    `tokens`: all but the last token (the switch evaluates it: its logits sample the next), while a round is left
    and at least two tokens came; None: switch now."""
    if rounds > CATCH_UP_ROUNDS or tokens - 1 - done < 2:
        return None
    return tokens - 1
