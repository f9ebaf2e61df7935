"""What the event loop hands the worker (a chat `Job`, a `ConfigJob`), and the worker's per-answer state."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from governor.engine.chat import ChatRequest, CompletionRequest, TextStream
from governor.engine.config import Applied
from governor.engine.events import Event
from governor.engine.grammar import Constraint
from policies.decision import EngineConfig


class Sink(Protocol):
    """Where a generation's events go (governor/engine/events.py)."""

    def __call__(self, event: Event) -> None: ...


@dataclass(eq=False)
class Job:
    request: ChatRequest | CompletionRequest
    sink: Sink
    constraint: Constraint = field(default_factory=lambda: Constraint(None, None))
    cancelled: threading.Event = field(default_factory=threading.Event)
    load_s: float = 0.0  # time the worker spent loading the model for this job (set before its Started event)
    adapter: str | None = None  # the LoRA adapter the answer runs with (None: the base model)
    skipped: int = 0  # times a later job went first because its adapter was the one in use (governor.engine.jobqueue)


@dataclass(eq=False)
class ConfigJob:
    target: EngineConfig  # the whole config to run, resolved once against the engine's models (config.resolve)
    done: Callable[[EngineConfig, Applied, float], None]
    fail: Callable[[Exception], None]
    tokens_at: int = 0  # tokens generated when the change arrived
    tokens_waited: int = 0  # tokens generated between its arrival and its application (0 or 1: the one in flight)


@dataclass
class Counters:
    generations_completed: int = 0
    generations_cancelled: int = 0
    generations_failed: int = 0
    tokens_generated_total: int = 0
    prompt_tokens_total: int = 0
    reloads_total: int = 0
    trimmed_messages_total: int = 0
    prompt_tokens_evaluated_total: int = 0  # prompt tokens llama.cpp evaluated (the rest came from the KV cache)
    context_shifts_total: int = 0  # answers whose prompt reused the cache by moving it (governor.engine.window)
    shifted_tokens_total: int = 0  # tokens those shifts removed from the cache
    cache_copies_total: int = 0  # reloads (an n_ctx change) that copied the KV cache into the new context
    warm_swaps_total: int = 0  # reloads (a KV type change) built beside the answering context (governor.engine.swap)


@dataclass(eq=False)
class Run:
    """One generation in progress: what it needs to continue in a rebuilt context."""

    job: Job
    messages: list[dict[str, str]] | None  # None: a plain completion of `prompt`
    prompt: str | None
    ctx_tokens: list[int]  # everything evaluated (or to be) in the current context: prompt + answer so far
    n_prompt: int
    text: TextStream
    answer_from: int = 0  # where the answer starts in ctx_tokens (after a re-render it is re-tokenized text)
    answer: bytearray = field(default_factory=bytearray)
    n_completion: int = 0
    trimmed: int = 0
    gen: Any = None
    prefilling: bool = True  # the next `next(gen)` evaluates the prompt first
    model_name: str = ""
    finish: str | None = None
    evaluated_from: int = 0  # the model's evaluated-token counter when this answer's prompt evaluation began
    prompt_evaluated: int | None = None  # prompt tokens evaluated for this answer (known once the prefill ended)
    shifted: int = 0  # tokens the context shift removed from the cache for this answer
    decoded: int = 0  # tokens decoded after the first (the first one's call also evaluated the prompt) ...
    decode_s: float = 0.0  # ... and the seconds they took: the answer's own decode rate, free of the stream's pace

    def decoded_one(self, seconds: float) -> None:
        self.decoded += 1
        self.decode_s += seconds

    def decode_tokens_per_s(self) -> float | None:
        return round(self.decoded / self.decode_s, 3) if self.decoded and self.decode_s > 0 else None


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
