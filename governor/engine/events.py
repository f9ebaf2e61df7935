"""What the worker tells an answer's consumer, in order: `Started`, then `Text`, `ModelChanged`, `Trimmed` any number
of times, and last `Ended` or `Failed` (a `Failed` may also come first, instead of `Started`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Started:
    model: str
    prompt_tokens: int
    trimmed: int  # messages left out of the prompt to fit the context


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class ModelChanged:
    """A reload mid-answer moved it to another model tier."""

    model: str


@dataclass(frozen=True, slots=True)
class Trimmed:
    """A reload mid-answer trimmed more messages; `total` counts all of them."""

    total: int


@dataclass(frozen=True, slots=True)
class Ended:
    finish: str  # the OpenAI finish_reason: "stop", "length" or "cancelled"
    usage: dict[str, int]
    governor: dict[str, Any] = field(default_factory=dict)  # the answer's "governor" fields (context, shifted, ...)


@dataclass(frozen=True, slots=True)
class Failed:
    status: int  # the HTTP status the API answers with
    message: str
    code: str


Event = Started | Text | ModelChanged | Trimmed | Ended | Failed
Last = Ended | Failed


def stopping() -> Failed:
    return Failed(503, "the engine is shutting down", "engine_stopping")
