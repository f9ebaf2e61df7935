"""Honest refusals: a request field this engine does not implement is a 400 naming it, never silently ignored.

A request is first validated by its pydantic model (chat.ChatRequest / chat.CompletionRequest: the fields honoured,
strictly typed); whatever else it carries lands in `model_extra` and is judged here, against one table. A field
sent with its neutral value (`"n": 1`, `"logprobs": false`, `null`, ...) asks for nothing and passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from governor.engine.chat import ChatRequest, CompletionRequest, Sampling

# Fields OpenAI (or llama.cpp's server) defines that mean nothing to a local engine: accepted, ignored, and why.
IGNORED: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "metadata": "tags for OpenAI's stored completions",
    "prompt_cache_key": "a hint for OpenAI's prompt cache",
    "cache_prompt": "llama.cpp server's prompt-cache hint (this engine reuses the cached prefix of the running model)",
}

# Fields refused unless sent with one of their neutral values (which ask for nothing).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "modalities": (["text"],),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "echo": (False,),
    "suffix": ("",),
    "stream_options": (),
}

# Why each known field is not implemented (the 400's message). Any other field gets a generic message.
UNSUPPORTED: dict[str, str] = {
    "n": "one choice per request (n = 1)",
    "best_of": "one candidate per request (best_of = 1)",
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "logit_bias": "logit bias is not applied",
    "audio": "audio output is not supported (text only)",
    "modalities": 'only text output (modalities = ["text"])',
    "prediction": "predicted outputs are not supported",
    "web_search_options": "there is no web search",
    "functions": "the legacy `functions` field is not implemented: send `tools`",
    "function_call": "the legacy `function_call` field is not implemented: send `tool_choice`",
    "reasoning_effort": "no reasoning models are served",
    "verbosity": "no verbosity control",
    "store": "completions are not stored",
    "service_tier": "there is one service tier",
    "echo": "the prompt is not echoed",
    "suffix": "no insertion (suffix) mode",
    "grammar": "llama.cpp server's `grammar` is not implemented: send `response_format` with a JSON schema",
    "json_schema": "llama.cpp server's top-level `json_schema` is not implemented: send `response_format`",
    "typical_p": "locally typical sampling is not implemented",
    "mirostat": "mirostat sampling is not implemented",
    "n_probs": "token probabilities are not returned",
    "n_predict": "llama.cpp server's `n_predict` is not implemented: send `max_tokens`",
}

# Inside a chat message.
MESSAGE_IGNORED = frozenset({"refusal"})  # an assistant's earlier refusal text: read as content would be nothing new
MESSAGE_UNSUPPORTED: dict[str, str] = {
    "audio": "audio in messages is not supported (text only)",
    "function_call": "the legacy `function_call` is not implemented: send `tool_calls`",
}
PART_UNSUPPORTED: dict[str, str] = {
    "image_url": "image content is not supported (text only)",
    "input_audio": "audio content is not supported (text only)",
    "file": "file content is not supported (text only)",
    "refusal": "refusal content parts are not read",
}


@dataclass(frozen=True)
class Refusal:
    param: str
    message: str
    code: str = "unsupported_field"


def _field(name: str, value: Any, where: str = "") -> Refusal | None:
    if name in IGNORED or value is None:
        return None
    if name in NEUTRAL and any(value == v and type(value) is type(v) for v in NEUTRAL[name]):
        return None
    why = UNSUPPORTED.get(name, "not implemented by this engine")
    return Refusal(f"{where}{name}", f"{where}{name}: {why}")


def check(req: Sampling) -> Refusal | None:
    """The first field of `req` this engine does not implement, or None."""
    for name, value in (req.model_extra or {}).items():
        refusal = _field(name, value)
        if refusal is not None:
            return refusal
    if isinstance(req, ChatRequest):
        return _check_messages(req)
    assert isinstance(req, CompletionRequest)
    return None


def _check_messages(req: ChatRequest) -> Refusal | None:
    for i, msg in enumerate(req.messages):
        where = f"messages.{i}."
        for name, value in (msg.model_extra or {}).items():
            if name in MESSAGE_IGNORED or value is None:
                continue
            why = MESSAGE_UNSUPPORTED.get(name, "not implemented by this engine")
            return Refusal(f"{where}{name}", f"{where}{name}: {why}")
        if isinstance(msg.content, list):
            for j, part in enumerate(msg.content):
                if part.type == "text" and part.text is not None:
                    continue
                why = PART_UNSUPPORTED.get(part.type, f"content of type {part.type!r} is not supported (text only)")
                if part.type == "text":
                    why = "a text part needs `text`"
                return Refusal(f"{where}content.{j}.type", f"{where}content.{j}: {why}")
        if msg.tool_calls and msg.role != "assistant":
            return Refusal(f"{where}tool_calls", f"{where}tool_calls: only assistant messages carry tool calls")
    return None
