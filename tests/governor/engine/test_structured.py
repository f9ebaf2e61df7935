"""Structured output and tool calls on the real model (SmolLM2-135M-Instruct), through the official openai SDK over
the engine's Unix socket, streamed and not."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.governor.engine.engine_proc import Chunked, Engine, real_model
from tests.helpers import eventually

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
}
PERSON_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME: Any = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now", "parameters": {"type": "object", "properties": {}}},
}
MODEL = real_model().stem
ASK: list[Any] = [{"role": "user", "content": "Describe a person who lives in a city, as JSON."}]
ASK_WEATHER: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = Engine(tmp_path_factory.mktemp("structured"), "--model", str(real_model()), "--threads", "1", "--ctx", "2048")
    yield eng
    assert eng.stop() == 0, eng.log()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[openai.OpenAI]:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(engine.socket)))
    with openai.OpenAI(base_url="http://engine/v1", api_key="x", http_client=http) as c:  # type: ignore[arg-type]
        yield c


def test_json_schema_answer_validates(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=PERSON_FORMAT, max_tokens=120, temperature=0.0
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_streamed_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=PERSON_FORMAT, max_tokens=120, temperature=0.7, seed=5, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_a_json_object(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with the keys name and age of a cat."}],
        response_format={"type": "json_object"},
        max_tokens=150,
        temperature=0.0,
    )
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content or ""), dict)


def test_unsupported_schema_feature_is_a_400_naming_it(client: openai.OpenAI) -> None:
    schema: Any = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )
    body: Any = refused.value.body
    assert body["param"] == "response_format.json_schema.schema.properties.age.minimum"
    assert "'minimum' is not supported" in body["message"]


def _round_trip(client: openai.OpenAI, *, stream: bool) -> None:
    """Call -> tool result -> final answer, as an agent does it."""
    kwargs: Any = {"model": MODEL, "tools": [WEATHER, TIME], "max_tokens": 80, "temperature": 0.0}
    if stream:
        call = _streamed_call(client.chat.completions.create(messages=ASK_WEATHER, tool_choice="required",
                                                             stream=True, **kwargs))  # fmt: skip
    else:
        done = client.chat.completions.create(messages=ASK_WEATHER, tool_choice="required", **kwargs)
        assert done.choices[0].finish_reason == "tool_calls"
        assert done.choices[0].message.content is None
        calls: Any = done.choices[0].message.tool_calls
        assert calls is not None
        assert len(calls) == 1
        assert calls[0].type == "function"
        call = {"id": calls[0].id, "name": calls[0].function.name, "arguments": calls[0].function.arguments}
    assert call["name"] in ("get_weather", "get_time")
    schema = WEATHER if call["name"] == "get_weather" else TIME
    jsonschema.validate(json.loads(call["arguments"]), schema["function"]["parameters"])
    history: list[Any] = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
        ]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 22 degrees celsius."},
    ]  # fmt: skip
    final = client.chat.completions.create(messages=history, tool_choice="none", **kwargs)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content


def _streamed_call(stream: Any) -> dict[str, str]:
    """Assemble a streamed tool call the way the SDK's users do: header delta, then argument fragments."""
    call: dict[str, str] = {"arguments": ""}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    return call


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    _round_trip(client, stream=False)


def test_tool_call_round_trip_streamed(client: openai.OpenAI) -> None:
    _round_trip(client, stream=True)


def test_named_tool_choice_calls_that_tool(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    )
    calls: Any = done.choices[0].message.tool_calls
    assert calls is not None
    assert calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments) == {}


def test_auto_answers_with_a_call_or_text(client: openai.OpenAI) -> None:
    for seed in range(3):
        done = client.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=60, seed=seed, temperature=1.0
        )
        choice = done.choices[0]
        calls: Any = choice.message.tool_calls
        if calls:
            assert choice.finish_reason == "tool_calls"
            jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
        else:
            assert choice.message.content
            assert not choice.message.content.startswith("<")


def test_grammar_state_continues_across_a_reload_mid_answer(engine: Engine) -> None:
    """A context/KV rebuild mid-answer: the stream goes on where it was and the whole answer still validates."""
    assert engine.config(max_tokens_per_s=8).status_code == 200
    try:
        body = {"messages": ASK, "response_format": PERSON_FORMAT, "max_tokens": 120, "temperature": 0.0}
        seen = Chunked()
        thread = threading.Thread(target=engine.stream, args=(body,), kwargs={"out": seen}, daemon=True)
        thread.start()
        eventually(lambda: len(seen.arrivals) >= 4, timeout_s=60)
        before = engine.status()["reloads_total"]
        r = engine.config(n_ctx=1024, max_tokens_per_s=None)
        assert r.status_code == 200, r.text
        assert r.json()["applied"] == "reload"
        thread.join(120)
        assert seen.done
        assert engine.status()["reloads_total"] == before + 1
        assert engine.log_events("engine.config")[-1]["mid_answer"] is True
        jsonschema.validate(json.loads(seen.text), PERSON)
    finally:
        engine.config(n_ctx=2048, max_tokens_per_s=None)


def test_plain_completion(engine: Engine) -> None:
    r = engine.http.post(
        "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] <= 8
