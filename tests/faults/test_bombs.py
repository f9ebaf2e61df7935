"""Resource bombs in valid JSON (issue 33): well-formed requests that ask the engine for an unbounded amount of
memory or time -- a JSON schema's lengths and counts, a pattern's repetitions, their sum over a request -- and the
fields that gave a 500 instead of a 400. Each gets a 400 naming the field, at once, and the same engine (its pid)
goes on answering: none of them may grow it, hang it or get it killed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.faults.test_api import client
from tests.governor.daemon.daemon_proc import DaemonProc

pytestmark = pytest.mark.slow
FAULT_KIND = "resource bombs in valid JSON"

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def schema(s: Any) -> dict[str, Any]:
    return {
        "messages": HI,
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
    }


def tool(parameters: Any, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def many_strings(n: int, length: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": length} for i in range(n)}}


def nested_items(depth: int) -> str:
    """The JSON text itself: json.dumps would not write it (RecursionError)."""
    inner = '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth
    return '{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", ' + (
        f'"json_schema": {{"name": "x", "schema": {inner}}}}}}}'
    )


# (id, path, body, a word the error message must contain)
CASES: list[tuple[str, str, dict[str, Any] | str, str]] = [
    ("maxLength 1e9", CHAT, schema({"type": "string", "maxLength": 1_000_000_000}), "maxLength"),
    ("minLength 1e18", CHAT, schema({"type": "string", "minLength": 10**18}), "minLength"),
    ("maxItems 2**70", CHAT, schema({"type": "array", "items": {"type": "integer"}, "maxItems": 2**70}), "maxItems"),
    ("minItems 1e9", CHAT, schema({"type": "array", "items": {"type": "integer"}, "minItems": 10**9}), "minItems"),
    ("maxLength -1", CHAT, schema({"type": "string", "maxLength": -1}), "maxLength"),
    ("maxLength 2.5", CHAT, schema({"type": "string", "maxLength": 2.5}), "maxLength"),
    ("maxLength a string", CHAT, schema({"type": "string", "maxLength": "10"}), "maxLength"),
    ("maxLength true", CHAT, schema({"type": "string", "maxLength": True}), "maxLength"),
    ("minLength above maxLength", CHAT, schema({"type": "string", "minLength": 9, "maxLength": 3}), "minLength"),
    ("pattern a{1000000000}", CHAT, schema({"type": "string", "pattern": "^a{1000000000}$"}), "pattern"),
    ("pattern nested (a{100}){1000}", CHAT, schema({"type": "string", "pattern": "^(a{100}){1000}$"}), "pattern"),
    ("pattern 20-digit count", CHAT, schema({"type": "string", "pattern": "^a{99999999999999999999}$"}), "pattern"),
    ("pattern a{2,3000}{3000}", CHAT, schema({"type": "string", "pattern": "^(b(a{2,3000}){3000})$"}), "pattern"),
    ("100 strings of 1000", CHAT, schema(many_strings(100, 1000)), "add up"),
    ("items 2000 deep", CHAT, nested_items(2000), "recursion"),
    ("enum of 100,000", CHAT, schema({"enum": [f"v{i}" for i in range(100_000)]}), "add up"),
    ("tool maxItems 1e9", CHAT, {"messages": HI, "tools": [tool({"type": "array", "maxItems": 10**9})]}, "maxItems"),
    (
        "128 tools of 1000 each",
        CHAT,
        {"messages": HI, "tools": [tool(many_strings(1, 1000), f"f{i}") for i in range(128)]},
        "add up",
    ),
    ("completions empty prompt", COMPLETIONS, {"prompt": "", "max_tokens": 4}, "prompt"),
    ("completions [''] prompt", COMPLETIONS, {"prompt": [""], "max_tokens": 4}, "prompt"),
    ("stream_options unknown", CHAT, {"messages": HI, "stream": True, "stream_options": {"evil": 1}}, "evil"),
    ("four stop strings of 1 MB", CHAT, {"messages": HI, "stop": ["x" * (1 << 20)] * 4}, "stop"),
]


@pytest.fixture(scope="module")
def http(victim: DaemonProc) -> Iterator[httpx.Client]:
    with client(victim.engine_socket) as public:
        yield public


@pytest.mark.parametrize("case", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bomb_in_valid_json_is_a_400_and_the_engine_stays(
    http: httpx.Client, victim: DaemonProc, case: tuple[str, dict[str, Any] | str, str]
) -> None:
    path, body, word = case
    pid = victim.status()["supervisor"]["pid"]
    content = body if isinstance(body, str) else json.dumps(body)
    answer = http.post(path, content=content, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text[:300]
    message = answer.json()["error"]["message"]
    assert word in message, message
    assert "\n" not in message
    victim.check_alive()
    assert victim.engine.status().model  # the engine still answers...
    assert victim.status()["supervisor"]["pid"] == pid  # ...and it is the same one


def test_the_bounds_leave_real_schemas_alone(http: httpx.Client, victim: DaemonProc) -> None:
    """The largest count allowed (1000) is served: the bound refuses bombs, not schemas."""
    body = schema({"type": "string", "maxLength": 1000})
    answer = http.post(CHAT, json=body)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["choices"][0]["message"]["content"].startswith('"')  # a JSON string begins (4 tokens)
