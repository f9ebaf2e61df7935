"""EngineClient against a small real Starlette app served by uvicorn on a Unix socket (the engine's API shape).

The same client against the real engine process is in test_client_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from governor.daemon.driver import EngineDriver
from governor.daemon.llamacpp import LlamaCppPython
from governor.engine.client import EngineClient, EngineError, EngineUnavailable
from policies.decision import EngineConfig
from sensors.snapshot import EngineObservation

MODELS = ("large", "small")


def openai_error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class FakeEngine:
    """The engine's HTTP contract with trivial behaviour: settings in a dict, a canned gibberish answer."""

    def __init__(self) -> None:
        self.settings: dict[str, Any] = {
            "model": "large",
            "n_ctx": 2048,
            "kv_type": "f16",
            "threads": 2,
            "max_tokens_per_s": None,
            "n_batch": 512,
            "lora_pool_mib": 64.0,
        }
        self.posted: list[dict[str, Any]] = []
        self.status_code = 200
        self.disconnected = threading.Event()
        self.app = Starlette(
            routes=[
                Route("/engine/status", self.status),
                Route("/engine/config", self.config, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )

    async def status(self, request: Request) -> Response:
        if self.status_code != 200:
            return PlainTextResponse("engine is sulking", status_code=self.status_code)
        return JSONResponse(
            {
                **self.settings,
                "busy": False,
                "tokens_per_s": 12.5,
                "queue_length": 0,
                "rss_bytes": 123456789,
                "pid": 1,
                "context_tokens": 300,
            }
        )

    async def config(self, request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return openai_error(400, "body is not JSON", "invalid_json")
        self.posted.append(body)
        unknown = set(body) - set(self.settings)
        if unknown:
            return openai_error(400, f"unknown fields {sorted(unknown)}", "invalid_field", param=sorted(unknown)[0])
        if "model" in body and body["model"] not in MODELS:
            return openai_error(
                404, f"unknown model {body['model']!r};\n this engine has {list(MODELS)}", "model_not_found", "model"
            )
        before = dict(self.settings)
        self.settings.update(body)
        reload = any(before[k] != self.settings[k] for k in ("model", "n_ctx", "kv_type"))
        return JSONResponse({"config": self.settings, "applied": "reload" if reload else "live", "seconds": 0.25})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"} for m in MODELS]})

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        words = ["gib", "ber", "ish"] * 20
        n = int(body.get("max_tokens", 3))
        if not body.get("stream"):
            return JSONResponse(
                {
                    "object": "chat.completion",
                    "model": self.settings["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words[:n])}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
                }
            )

        async def events() -> AsyncIterator[str]:
            try:
                for w in words[:n]:
                    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": w}}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    await asyncio.sleep(0.01)
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                self.disconnected.set()
                raise

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def fake_engine(tmp_path: Path) -> Iterator[tuple[FakeEngine, Path]]:
    engine = FakeEngine()
    sock = tmp_path / "engine.sock"
    server = uvicorn.Server(uvicorn.Config(engine.app, uds=str(sock), log_level="warning", lifespan="off", ws="none"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with EngineClient(sock, timeout_s=5) as probe:
            probe.wait_ready(10)
        yield engine, sock
    finally:
        server.should_exit = True
        thread.join(10)


def test_status_reads_the_engine_and_keeps_fields_it_does_not_know(fake_engine: tuple[FakeEngine, Path]) -> None:
    _, sock = fake_engine
    with EngineClient(sock) as client:
        status = client.status()

    assert (status.model, status.n_ctx, status.kv_type, status.threads) == ("large", 2048, "f16", 2)
    assert status.max_tokens_per_s is None
    assert status.busy is False
    assert status.tokens_per_s == 12.5
    assert status.rss_bytes == 123456789
    assert status.context_tokens == 300
    assert status.model_extra == {"pid": 1}


def test_configure_posts_only_the_given_fields_and_returns_how_they_were_applied(
    fake_engine: tuple[FakeEngine, Path],
) -> None:
    engine, sock = fake_engine
    with EngineClient(sock) as client:
        live = client.configure(threads=1, max_tokens_per_s=4.0)
        reload = client.configure(model="small")
        uncapped = client.configure(max_tokens_per_s=None)

    assert engine.posted == [{"threads": 1, "max_tokens_per_s": 4.0}, {"model": "small"}, {"max_tokens_per_s": None}]
    assert (live.applied, live.config.threads, live.config.max_tokens_per_s, live.seconds) == ("live", 1, 4.0, 0.25)
    assert (reload.applied, reload.config.model, reload.config.threads) == ("reload", "small", 1)
    assert uncapped.config.max_tokens_per_s is None


def test_configure_refuses_a_field_the_engine_does_not_have_before_sending(
    fake_engine: tuple[FakeEngine, Path],
) -> None:
    engine, sock = fake_engine
    with EngineClient(sock) as client, pytest.raises(TypeError, match="unknown fields \\['thread'\\]"):
        client.configure(thread=1)
    assert engine.posted == []


def test_an_engine_error_is_one_line_with_the_status_and_the_openai_message(
    fake_engine: tuple[FakeEngine, Path],
) -> None:
    _, sock = fake_engine
    with EngineClient(sock) as client, pytest.raises(EngineError) as caught:
        client.configure(model="huge")

    err = caught.value
    assert str(err) == (f"engine at {sock}: HTTP 404: unknown model 'huge'; this engine has ['large', 'small']")
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")


def test_a_non_json_error_body_is_still_one_line(fake_engine: tuple[FakeEngine, Path]) -> None:
    engine, sock = fake_engine
    engine.status_code = 503
    with EngineClient(sock) as client, pytest.raises(EngineError, match=r"HTTP 503: engine is sulking$"):
        client.status()


def test_the_driver_posts_the_whole_decision_and_observes(
    fake_engine: tuple[FakeEngine, Path],
) -> None:
    engine, sock = fake_engine
    config = EngineConfig(threads=1, n_ctx=1024, kv_type="q8_0", model="small", max_tokens_per_s=None)
    driver: EngineDriver = LlamaCppPython(Path("ladder.toml"), sock)  # its client, as the daemon uses it
    try:
        driver.apply(config)
        observed = driver.observe()
    finally:
        driver.close()

    assert engine.posted == [config.model_dump()]
    assert observed == EngineObservation(
        busy=False, tokens_per_s=12.5, model="small", rss_bytes=123456789, threads=1, context_tokens=300
    )


def test_observe_is_none_while_the_engine_answers_an_error(
    fake_engine: tuple[FakeEngine, Path], captured_logs: list[dict[str, Any]]
) -> None:
    engine, sock = fake_engine
    engine.status_code = 500
    with EngineClient(sock) as client:
        assert client.observe() is None
    assert [e["event"] for e in captured_logs] == ["engine status unavailable"]
    assert "HTTP 500" in captured_logs[0]["error"]


def test_observe_is_none_and_status_raises_when_nobody_listens(tmp_path: Path) -> None:
    sock = tmp_path / "nobody.sock"
    with EngineClient(sock, timeout_s=1) as client:
        assert client.observe() is None
        with pytest.raises(EngineUnavailable, match=f"^engine at {sock}: cannot connect"):
            client.status()


def test_wait_ready_gives_up_after_its_timeout(tmp_path: Path) -> None:
    with EngineClient(tmp_path / "nobody.sock", timeout_s=1) as client, pytest.raises(EngineUnavailable) as caught:
        client.wait_ready(0.2)
    assert "not ready within 0.2 s (cannot connect" in str(caught.value)


def test_wait_ready_stops_as_soon_as_the_engine_process_exits(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with EngineClient(tmp_path / "nobody.sock", timeout_s=1) as client, pytest.raises(EngineUnavailable) as caught:
        client.wait_ready(60, process=proc)
    assert str(caught.value).endswith("the engine process exited with code 3")


def test_models_lists_the_engines_model_ids(fake_engine: tuple[FakeEngine, Path]) -> None:
    _, sock = fake_engine
    with EngineClient(sock) as client:
        assert client.models() == ["large", "small"]


def test_chat_and_stream_chat_return_the_openai_shapes(fake_engine: tuple[FakeEngine, Path]) -> None:
    _, sock = fake_engine
    messages = [{"role": "user", "content": "hello"}]
    with EngineClient(sock) as client:
        answer = client.chat(messages, max_tokens=3)
        chunks = list(client.stream_chat(messages, max_tokens=4))

    assert answer["choices"][0]["message"]["content"] == "gibberish"
    assert answer["usage"]["completion_tokens"] == 3
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "gibberishgib"


def test_closing_a_stream_disconnects_from_the_engine(fake_engine: tuple[FakeEngine, Path]) -> None:
    engine, sock = fake_engine
    with EngineClient(sock) as client:
        stream = client.stream_chat([{"role": "user", "content": "hello"}], max_tokens=60)
        assert next(stream)["choices"][0]["delta"]["content"] == "gib"
        stream.close()
        assert engine.disconnected.wait(10)


@pytest.mark.parametrize("fill", [-1, 1 << 21])
def test_a_context_fill_out_of_range_is_refused_not_used(fill: int) -> None:
    """The fill sizes the device model's memory ceiling: a status line or a trace claiming an impossible one is
    a validation error that names the field, never a figure the allocator divides by."""
    with pytest.raises(ValidationError, match="context_tokens"):
        EngineObservation(busy=False, context_tokens=fill)


@pytest.mark.parametrize(
    ("field", "value"), [("tokens_per_s", "-1"), ("tokens_per_s", "NaN"), ("rss_bytes", "-5"), ("threads", "0")]
)
def test_an_engine_observation_out_of_range_is_refused_naming_the_field(field: str, value: str) -> None:
    """An engine's status or a trace line is outside input: a rate, size or count it could not have is a validation
    error that names it, never a figure the policy divides by or averages in."""
    with pytest.raises(ValidationError, match=field):
        EngineObservation.model_validate_json(f'{{"busy": true, "{field}": {value}}}')
