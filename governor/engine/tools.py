"""Tool calls: how tools are shown to the model, how earlier calls and results are written into the conversation,
and how the model's answer is read back as OpenAI `tool_calls` (streamed as deltas or whole).

The format is Hermes' (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results as `role: "tool"`
messages), which Qwen2.5, Hermes and SmolLM2 were trained on; the grammar (grammar.py) makes any model keep to it.
Tools are described in a system message, because most GGUF chat templates (SmolLM2's among them) have no `tools`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from governor.engine.chat import ChatRequest, Message, Tool
from governor.engine.grammar import TOOL_CLOSE, TOOL_OPEN

_HEAD = re.compile(r'\s*<tool_call>\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def tool_prompt(tools: list[Tool], *, must_call: bool) -> str:
    lines = [
        "You can call tools. To call one, answer with exactly",
        f'{TOOL_OPEN}\n{{"name": <tool name>, "arguments": <arguments as a JSON object>}}\n{TOOL_CLOSE}',
        "and nothing else; the result comes back in a tool message."
        + (" You must call one of these tools now." if must_call else " Otherwise answer normally."),
        "Tools:",
    ]
    for tool in tools:
        f = tool.function
        desc: dict[str, Any] = {"name": f.name}
        if f.description:
            desc["description"] = f.description
        desc["parameters"] = f.parameters or {"type": "object", "properties": {}}
        lines.append(json.dumps(desc, ensure_ascii=False))
    return "\n".join(lines)


def conversation(req: ChatRequest, tools: list[Tool] | None) -> list[dict[str, str]]:
    """The messages as the chat template gets them: earlier tool calls written as the model writes them, and the
    tool description added to the system message when calls are possible."""
    out = [{"role": m.role, "content": _content(m)} for m in req.messages]
    if tools:
        must = req.tool_choice not in (None, "auto")
        prompt = tool_prompt(tools, must_call=must)
        if out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _content(m: Message) -> str:
    text = m.text()
    if m.tool_calls:
        calls = [
            f'{TOOL_OPEN}\n{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments or "{}"}}}\n'
            f"{TOOL_CLOSE}"
            for c in m.tool_calls
        ]
        text = "\n".join([text, *calls]) if text else "\n".join(calls)
    return text


@dataclass
class ToolCallReader:
    """Reads an answer that may be a tool call, text piece by text piece, into OpenAI deltas.

    The grammar guarantees the shape: a call starts with "<tool_call>" (and then the name comes first), text never
    starts with "<". So the first character decides, the call's header (id, name) goes out once the name is
    complete, and its arguments stream as they come until the JSON object closes (json's own decoder says when).
    """

    buf: str = ""
    is_call: bool | None = None  # None until the first character
    name: str | None = None
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    _args_start: int = 0
    _args_sent: int = 0
    args_done: bool = False

    def push(self, text: str) -> list[dict[str, Any]]:
        """Deltas for a chunk: {"content": ...} or {"tool_calls": [...]}."""
        if not text:
            return []
        self.buf += text
        if self.is_call is None:
            self.is_call = self.buf.startswith("<")
        if not self.is_call:
            return [{"content": text}]
        out: list[dict[str, Any]] = []
        if self.name is None:
            head = _HEAD.match(self.buf)
            if head is None:
                return []
            self.name = json.loads(f'"{head.group(1)}"')
            self._args_start = self._args_sent = head.end()
            out.append(self._delta({"id": self.call_id, "type": "function", "function": {"name": self.name}}))
            out[0]["tool_calls"][0]["function"]["arguments"] = ""
        if not self.args_done:
            if self._args_sent == self._args_start:  # nothing sent yet: the arguments start at non-space
                while self._args_start < len(self.buf) and self.buf[self._args_start].isspace():
                    self._args_start += 1
                self._args_sent = self._args_start
            end = len(self.buf)
            if "}" in text and end > self._args_start:
                try:
                    _, n = json.JSONDecoder().raw_decode(self.buf, self._args_start)
                    end, self.args_done = n, True
                except json.JSONDecodeError:
                    pass
            if end > self._args_sent:
                out.append(self._delta({"function": {"arguments": self.buf[self._args_sent : end]}}))
                self._args_sent = end
        return out

    def _delta(self, call: dict[str, Any]) -> dict[str, Any]:
        return {"tool_calls": [{"index": 0, **call}]}

    @property
    def arguments(self) -> str:
        return self.buf[self._args_start : self._args_sent].strip()

    def finish_reason(self, engine_reason: str) -> str:
        """ "tool_calls" for a complete call; otherwise the engine's ("length" when cut off mid-call)."""
        return "tool_calls" if self.is_call and self.args_done and engine_reason == "stop" else engine_reason

    def message(self, engine_reason: str) -> dict[str, Any]:
        """The whole answer as a non-streamed `message`."""
        if not self.is_call:
            return {"role": "assistant", "content": self.buf}
        if self.name is None:  # cut off before the name was complete: nothing callable
            return {"role": "assistant", "content": self.buf}
        call = {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
