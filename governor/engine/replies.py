"""OpenAI response objects for one answer: chat (text or a tool call) and plain completions, streamed or whole.

Streamed chunk JSON is assembled from a pre-encoded head plus the changing part, so the per-token cost is one small
`json.dumps`. A reply turns the worker's text pieces into chunks (`text`), and its end into the last chunk or the
whole response (`end`, `full`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from governor.engine.tools import ToolCallReader


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class Reply:
    """A chat answer in plain text (the common case: each text piece is one content delta)."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.governor: dict[str, Any] = {"trimmed_messages": 0}
        self.parts: list[str] = []
        self.set_model(model)

    def set_model(self, model: str) -> None:
        self.model = model
        head = {"id": self.id, "object": self.object_chunk, "created": self.created, "model": model}
        self._head = dumps(head)[:-1]

    def _extra(self) -> str:
        return f',"governor":{dumps(self.governor)}' if self.governor["trimmed_messages"] else ""

    def _chunk(self, choice: dict[str, Any], usage: dict[str, int] | None = None) -> str:
        if usage is None:
            return f'data: {self._head},"choices":[{dumps(choice)}]{self._extra()}}}\n\n'
        # The finishing chunk (the one with usage) always says what the engine did with the prompt.
        extra = f',"usage":{dumps(usage)},"governor":{dumps(self.governor)}'
        return f'data: {self._head},"choices":[{dumps(choice)}]{extra}}}\n\n'

    def _delta(self, delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None) -> str:
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}, usage)

    def opening(self) -> str:
        return self._delta({"role": "assistant", "content": ""})

    def text(self, text: str) -> str:
        """The chunk for a piece of a streamed answer (the per-token path: no dict built and encoded)."""
        return (
            f'data: {self._head},"choices":[{{"index":0,"delta":{{"content":{json.dumps(text)}}},'
            f'"logprobs":null,"finish_reason":null}}]{self._extra()}}}\n\n'
        )

    def collect(self, text: str) -> None:
        """A piece of a non-streamed answer."""
        self.parts.append(text)

    def finish_reason(self, engine_reason: str) -> str:
        return engine_reason

    def end(self, engine_reason: str, usage: dict[str, int], include_usage: bool) -> str:
        out = self._delta({}, self.finish_reason(engine_reason), usage)
        if include_usage:
            out += f'data: {self._head},"choices":[],"usage":{dumps(usage)}}}\n\n'
        return out

    def message(self, engine_reason: str) -> dict[str, Any]:
        return {"role": "assistant", "content": "".join(self.parts)}

    def full(self, engine_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": self.message(engine_reason),
            "logprobs": None,
            "finish_reason": self.finish_reason(engine_reason),
        }
        return {
            "id": self.id,
            "object": self.object_full,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
            "governor": self.governor,
        }


class ToolReply(Reply):
    """A chat answer that may be a tool call: deltas as OpenAI streams them, finish_reason "tool_calls"."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.reader = ToolCallReader()

    def text(self, text: str) -> str:
        return "".join(self._delta(d) for d in self.reader.push(text))

    def collect(self, text: str) -> None:
        self.reader.push(text)

    def finish_reason(self, engine_reason: str) -> str:
        return self.reader.finish_reason(engine_reason)

    def message(self, engine_reason: str) -> dict[str, Any]:
        return self.reader.message(engine_reason)


class CompletionReply(Reply):
    """`/v1/completions`: `text_completion` objects with `choices[0].text`."""

    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def _piece(self, text: str, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": finish}, usage)

    def opening(self) -> str:
        return ""

    def text(self, text: str) -> str:
        return self._piece(text)

    def end(self, engine_reason: str, usage: dict[str, int], include_usage: bool) -> str:
        out = self._piece("", engine_reason, usage)
        if include_usage:
            out += f'data: {self._head},"choices":[],"usage":{dumps(usage)}}}\n\n'
        return out

    def full(self, engine_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        body = super().full(engine_reason, usage)
        body["choices"] = [{"index": 0, "text": "".join(self.parts), "logprobs": None, "finish_reason": engine_reason}]
        return body
