"""Request fields in-process (no model, no llama.cpp: the grammars themselves are tested through an engine
process in test_structured.py): refusals, schema checks, tool-call reading, history rendering."""

from __future__ import annotations

import json
from typing import Any

import pytest

from governor.engine import refusals
from governor.engine.chat import ChatRequest, CompletionRequest
from governor.engine.grammar import SchemaRefused, check_schema, constraint, pointer_to_param
from governor.engine.tools import ToolCallReader, conversation

HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def chat(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate({"messages": HI, **fields})


def test_neutral_values_ask_for_nothing() -> None:
    req = chat(n=1, logprobs=False, top_logprobs=0, logit_bias={}, modalities=["text"], store=False, user="u")
    assert refusals.check(req) is None


@pytest.mark.parametrize("name", sorted(refusals.UNSUPPORTED))
def test_every_unsupported_field_is_named(name: str) -> None:
    value: Any = {"n": 2, "best_of": 3, "logprobs": True, "top_logprobs": 2, "echo": True, "store": True}.get(name, "x")
    refusal = refusals.check(chat(**{name: value}))
    assert refusal is not None
    assert refusal.param == name
    assert refusal.message.startswith(f"{name}: ")


def test_an_unknown_field_is_refused_and_an_ignored_one_is_not() -> None:
    refusal = refusals.check(chat(mirostat_tau=5.0))
    assert refusal is not None
    assert (refusal.param, refusal.message) == ("mirostat_tau", "mirostat_tau: not implemented by this engine")
    for name in refusals.IGNORED:
        assert refusals.check(chat(**{name: "something"})) is None


def test_image_content_is_refused_at_its_part() -> None:
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:"}}]
    refusal = refusals.check(ChatRequest.model_validate({"messages": [{"role": "user", "content": parts}]}))
    assert refusal is not None
    assert refusal.param == "messages.0.content.1.type"
    assert "image" in refusal.message


def test_completion_fields_are_judged_too() -> None:
    assert refusals.check(CompletionRequest.model_validate({"prompt": "a", "echo": False})) is None
    refusal = refusals.check(CompletionRequest.model_validate({"prompt": "a", "suffix": "z"}))
    assert refusal is not None
    assert refusal.param == "suffix"


UNSUPPORTED_SCHEMAS: list[tuple[dict[str, Any], str]] = [
    ({"type": "integer", "minimum": 0}, "/minimum"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}, "/properties/n/multipleOf"),
    ({"type": "string", "format": "email"}, "/format"),
    ({"not": {"type": "string"}}, "/not"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "/uniqueItems"),
    ({"$ref": "https://example.com/schema.json"}, "/$ref"),
    ({"type": "decimal"}, "/type"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "/minLength"),
]


@pytest.mark.parametrize(("schema", "where"), UNSUPPORTED_SCHEMAS)
def test_unsupported_schema_feature_is_named(schema: dict[str, Any], where: str) -> None:
    with pytest.raises(SchemaRefused) as refused:
        check_schema(schema)
    assert refused.value.where == where


def test_schema_refusal_is_located_in_the_request() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "maximum": 3}}}
    with pytest.raises(SchemaRefused) as refused:
        constraint(chat(response_format=fmt))
    assert pointer_to_param(refused.value.where) == "response_format.json_schema.schema.maximum"
    bad_tool = json.loads(json.dumps(WEATHER))
    bad_tool["function"]["parameters"]["properties"]["city"]["minLength"] = 1
    bad_tool["function"]["parameters"]["properties"]["days"] = {"type": "integer", "exclusiveMinimum": 0}
    with pytest.raises(SchemaRefused) as refused:
        constraint(chat(tools=[bad_tool], tool_choice="required"))
    assert pointer_to_param(refused.value.where) == "tools.0.function.parameters.properties.days.exclusiveMinimum"


def test_tool_choice_needs_a_declared_tool() -> None:
    with pytest.raises(SchemaRefused, match="no tool named 'nope'"):
        constraint(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}))
    with pytest.raises(SchemaRefused, match="needs `tools`"):
        constraint(chat(tool_choice="required"))
    assert constraint(chat(tools=[WEATHER], tool_choice="none")).grammar is None


def test_tool_call_streams_name_first_then_arguments() -> None:
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {x}"}}\n</tool_call>'
    for cut in range(1, len(answer)):
        reader = ToolCallReader()
        deltas = reader.push(answer[:cut]) + reader.push(answer[cut:])
        calls = [d["tool_calls"][0] for d in deltas]
        assert calls[0]["function"]["name"] == "get_weather"
        assert calls[0]["id"].startswith("call_")
        assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris {x}"}'
        assert reader.finish_reason("stop") == "tool_calls"
        message = reader.message("stop")
        assert message["content"] is None
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris {x}"}


def test_text_answer_and_a_cut_off_call() -> None:
    reader = ToolCallReader()
    assert reader.push("It is ") == [{"content": "It is "}]
    assert reader.push("sunny.") == [{"content": "sunny."}]
    assert reader.finish_reason("stop") == "stop"
    assert reader.message("stop") == {"role": "assistant", "content": "It is sunny."}
    cut = ToolCallReader()
    cut.push('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert cut.finish_reason("length") == "length"
    assert cut.message("length")["tool_calls"][0]["function"]["arguments"] == '{"ci'


def test_history_with_tool_calls_and_results_is_rendered_as_text() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"P"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
        ],
        tools=[WEATHER],
    )
    msgs = conversation(req, req.tools)
    assert msgs[0]["role"] == "system"
    assert msgs[0]["content"].startswith("be brief\n\nYou can call tools.")
    assert '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city":"P"}}\n</tool_call>'
    assert msgs[3] == {"role": "tool", "content": "22 C"}
