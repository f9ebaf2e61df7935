"""Chat requests: the OpenAI request body, prompt rendering with the model's template, trimming, and text output.

Pure Python over a `Tokenizer` protocol, so the worker can re-render a conversation for a new model or context.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(BaseModel):
    """One part of a message's content; only "text" parts are read (refusals.py refuses the others by name)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A tool call in an earlier assistant message of the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this is the result of

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


MAX_STOP_CHARS = 1000


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a misspelt option is a 400, not silently nothing

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionName


class GovernorOptions(BaseModel):
    """A request's `governor` object: what this engine offers beyond OpenAI's fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    adapter: str | None = Field(default=None, min_length=1, max_length=64)  # a ladder LoRA adapter; null: none


class Sampling(BaseModel):
    """Fields shared by chat and plain completions. Fields not declared here or in a subclass are collected
    (`extra="allow"`) and judged by refusals.py: honoured, harmlessly ignored, or a 400 naming the field.
    `strict` so that "0.5" is not silently a float."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    # Optional, as llama.cpp's server and Ollama allow: the governor, not the client, picks the tier.
    model: str | None = Field(default=None, min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    temperature: float = Field(default=0.8, ge=0, le=2)
    top_p: float = Field(default=0.95, gt=0, le=1)
    top_k: int = Field(default=40, ge=0, le=1 << 20)
    min_p: float = Field(default=0.05, ge=0, le=1)
    repeat_penalty: float = Field(default=1.0, gt=0, le=100)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=0, lt=1 << 32)
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # llama.cpp server's extension: an end-of-generation token does not end the answer
    governor: GovernorOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(len(one) > MAX_STOP_CHARS for one in ([v] if isinstance(v, str) else v or [])):
            # The answer's text is held back and searched for each one at every token: 4 MB of them hung the engine.
            raise ValueError(f"a stop sequence is at most {MAX_STOP_CHARS} characters")
        return v

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]

    def token_limit(self) -> int | None:
        return self.max_tokens

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for `Llama.generate`."""
        return {
            "temp": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }


class ChatRequest(Sampling):
    """OpenAI's chat completion request, as far as this engine honours it."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # at most one call per answer either way (allowed, not required)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    """OpenAI's (legacy) plain completion: a prompt continued without a chat template."""

    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1, le=1 << 20)  # OpenAI's default for this endpoint

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("one prompt per request (a list of exactly one string)")
        if not (v if isinstance(v, str) else v[0]):
            raise ValueError("the prompt is empty: there is nothing to continue")
        return v

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class Tokenizer(Protocol):
    """What prompt fitting needs from a loaded model (the worker's LoadedModel)."""

    def render(self, messages: Sequence[dict[str, str]]) -> str: ...

    def encode(self, text: str, *, prompt: bool) -> list[int]: ...


class PromptTooLong(Exception):
    def __init__(self, n_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"the last message alone needs {n_tokens} tokens of context; the engine's context holds {n_ctx}"
        )
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx


@dataclass(frozen=True)
class FittedPrompt:
    tokens: list[int]
    trimmed_messages: int  # how many of the oldest non-system messages were left out
    answer_tokens: int = 0  # the last this many tokens are `answer_so_far`


def room_for_answer(n_ctx: int, max_tokens: int | None) -> int:
    """Context kept free for the answer when deciding what history fits: up to a quarter of the context."""
    return min(max_tokens or n_ctx, n_ctx // 4)


def fit(
    tok: Tokenizer,
    messages: Sequence[dict[str, str]],
    n_ctx: int,
    *,
    answer_room: int,
    answer_so_far: str = "",
) -> FittedPrompt:
    """The longest recent part of the conversation that fits in `n_ctx` with `answer_room` tokens to spare.

    Leading system messages and the last message are always kept; older turns go first, a whole turn at a time
    (a turn starts at a user message). `answer_so_far` (a reply being generated) is appended after the prompt.
    Raises PromptTooLong when even the kept messages do not fit at all.
    """
    n_system = 0
    while n_system < len(messages) - 1 and messages[n_system]["role"] in ("system", "developer"):
        n_system += 1
    head, rest = list(messages[:n_system]), list(messages[n_system:])
    suffix = tok.encode(answer_so_far, prompt=False) if answer_so_far else []
    dropped = 0
    while True:
        tokens = tok.encode(tok.render(head + rest), prompt=True) + suffix
        if len(tokens) + answer_room <= n_ctx or len(rest) <= 1:
            break
        cut = 1
        while cut < len(rest) - 1 and rest[cut]["role"] != "user":
            cut += 1
        rest = rest[cut:]
        dropped += cut
    if len(tokens) >= n_ctx:
        raise PromptTooLong(len(tokens), n_ctx)
    return FittedPrompt(tokens, dropped, len(suffix))


class TextStream:
    """Token bytes in, client text out: incremental UTF-8 decoding, and stop sequences held back until decided."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = list(stops)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""  # everything released to the client so far
        self.stopped = False

    def push(self, data: bytes) -> str:
        """Text that can be released now; sets `stopped` when a stop sequence appeared (it is not released)."""
        new = self._decoder.decode(data)
        if not self._stops:
            self.text += new
            return new
        buf = self._held + new
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            out = buf[:cut]
        else:
            hold = _partial_stop_len(buf, self._stops, self._keep)
            out, self._held = buf[: len(buf) - hold], buf[len(buf) - hold :]
        self.text += out
        return out

    def flush(self) -> str:
        """At the end: release what was held back as a possible stop sequence."""
        out = "" if self.stopped else self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        self.text += out
        return out

    def reset_decoder(self) -> None:
        """After a model swap the new tokenizer starts at a character boundary."""
        self._decoder.reset()


def _partial_stop_len(buf: str, stops: Sequence[str], keep: int) -> int:
    """Length of the longest suffix of `buf` that begins some stop sequence."""
    for n in range(min(keep, len(buf)), 0, -1):
        tail = buf[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0
