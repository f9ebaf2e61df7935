"""The engine's API against one real engine process on the demo models, over its Unix socket."""

from __future__ import annotations

import json
import math
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from governor.engine import refusals
from tests.governor.engine.engine_proc import Engine, ladder_with_noflash, user
from tests.helpers import eventually

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(demo_ladder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    directory = tmp_path_factory.mktemp("server")
    ladder = ladder_with_noflash(demo_ladder, directory, broken=True)
    eng = Engine(directory, "--models", str(ladder), "--tier", "small", "--threads", "1", "--queue", "2")
    yield eng
    assert eng.stop() == 0, eng.log()


@pytest.fixture
def uncapped(engine: Engine) -> Iterator[Engine]:
    yield engine
    engine.config(max_tokens_per_s=None)


def test_socket_is_private(engine: Engine) -> None:
    assert stat.S_IMODE(engine.socket.stat().st_mode) == 0o600


def test_chat_answers_with_usage(engine: Engine) -> None:
    start = time.perf_counter()
    r = engine.chat(model="small", messages=user("hello"), max_tokens=8, temperature=0.0, ignore_eos=True)
    wall_s = time.perf_counter() - start
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion"
    assert body["model"] == "small"
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert body["governor"]["trimmed_messages"] == 0
    # This tier's q8_0 cache with head_dim 32 is one llama.cpp cannot move (LoadedModel.can_shift)
    assert body["governor"]["context"] == "reevaluate"
    assert 0 < body["governor"]["prompt_tokens_evaluated"] <= usage["prompt_tokens"]
    # the 7 tokens after the first took no longer than the whole request
    assert 7 / wall_s <= body["governor"]["decode_tokens_per_s"] < math.inf


def test_model_may_be_left_out_like_llama_cpp_server(engine: Engine) -> None:
    r = engine.chat(messages=user("hello"), max_tokens=4, temperature=0.0, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "small"  # the tier the governor loaded, not one the client picked


def test_same_seed_same_answer(engine: Engine) -> None:
    body: dict[str, Any] = {"model": "small", "messages": user("again"), "max_tokens": 12, "seed": 7}
    first = engine.chat(**body, temperature=1.0).json()["choices"][0]["message"]["content"]
    second = engine.chat(**body, temperature=1.0).json()["choices"][0]["message"]["content"]
    assert first == second


def test_stream_matches_usage(engine: Engine) -> None:
    seen = engine.stream({"model": "small", "messages": user("tell me"), "max_tokens": 16, "ignore_eos": True})
    assert seen.done
    assert seen.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in seen.chunks)
    assert len({c["id"] for c in seen.chunks}) == 1
    assert seen.finish_reason == "length"
    assert seen.usage is not None
    assert seen.usage["completion_tokens"] == 16
    finishing = [c for c in seen.chunks if "usage" in c]
    assert finishing[0]["governor"]["decode_tokens_per_s"] > 0  # the engine's decode rate, whatever the stream's pace


def test_stop_sequence_ends_the_answer(engine: Engine) -> None:
    full = engine.chat(model="small", messages=user("x"), max_tokens=30, seed=3, temperature=0.0).json()
    text = full["choices"][0]["message"]["content"]
    stop = text[10:13]
    assert stop.strip(), text  # a stop sequence the answer is known to contain
    r = engine.chat(model="small", messages=user("x"), max_tokens=30, seed=3, temperature=0.0, stop=[stop]).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["message"]["content"] == text[: text.index(stop)]


EXTRA = {"ignore_eos": True}  # random weights may end an answer early; these tests count tokens


def test_openai_sdk_unchanged(engine: Engine) -> None:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(engine.socket)))
    # openai 3 is typed against httpx2 but takes an httpx client too, as users pass one.
    client = openai.OpenAI(base_url="http://engine/v1", api_key="x", http_client=http)  # type: ignore[arg-type]
    with client:
        assert {m.id for m in client.models.list()} == {"large", "medium", "small", "noflash", "broken"}
        done = client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_body=EXTRA
        )
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None
        assert done.usage.completion_tokens == 5
        stream = client.chat.completions.create(
            model="small",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 6
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        with pytest.raises(openai.NotFoundError, match="unknown model"):
            client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_unix_socket_stream(engine: Engine) -> None:
    body = json.dumps({"model": "small", "messages": user("hi"), "max_tokens": 4, "stream": True, "ignore_eos": True})
    out = subprocess.run(
        ["curl", "-sSN", "--unix-socket", str(engine.socket), "http://engine/v1/chat/completions",
         "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_models_lists_the_ladder(engine: Engine) -> None:
    data = engine.http.get("/v1/models").json()["data"]
    assert [(m["id"], m["loaded"]) for m in data] == [
        ("large", False), ("medium", False), ("small", True), ("noflash", False), ("broken", False)
    ]  # fmt: skip


BAD_CHAT: list[tuple[bytes, int, str | None]] = [
    (b'{"model": "small", "messages": [', 400, "invalid_json"),
    (b"not json at all", 400, "invalid_json"),
    (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400, None),
    (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}', 400, None),
    (b'{"model": "small", "messages": [{"role": "wizard", "content": "hi"}]}', 400, None),
    (b'{"model": "small", "messages": []}', 400, None),
    (b'{"model": "", "messages": [{"role": "user", "content": "hi"}]}', 400, None),
    (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "n": 3}', 400, None),
    (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "stop": ["a","b","c","d","e"]}', 400, None),
    (b'{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found"),
    (b"[1, 2]", 400, None),
    (b'{"model": "small", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, None),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD_CHAT)
def test_bad_chat_request_is_4xx_and_engine_keeps_serving(
    engine: Engine, body: bytes, status: int, code: str | None
) -> None:
    r = engine.http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    assert engine.chat(model="small", messages=user("still there?"), max_tokens=2).status_code == 200


def _unsupported_value(name: str) -> Any:
    return {"n": 2, "best_of": 3, "logprobs": True, "top_logprobs": 2, "echo": True, "store": True}.get(name, "x")


@pytest.mark.parametrize("name", sorted(refusals.UNSUPPORTED))
def test_every_unimplemented_field_is_a_400_naming_it(engine: Engine, name: str) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": user("hi"), "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ):
        r = engine.http.post(path, json={**body, name: _unsupported_value(name)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (name, "unsupported_field")
        assert err["message"].startswith(f"{name}: ")
        neutral = refusals.NEUTRAL.get(name, (None,))[0]
        assert engine.http.post(path, json={**body, name: neutral}).status_code == 200


def test_image_content_is_a_400_naming_the_part(engine: Engine) -> None:
    content = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = engine.chat(messages=[{"role": "user", "content": content}], max_tokens=2)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.content.1.type"


BAD_CONFIG: list[tuple[dict[str, Any] | bytes, int, str | None]] = [
    (b"{threads: 2}", 400, "invalid_json"),
    ({"threads": "two"}, 400, None),
    ({"threads": 0}, 400, None),
    ({"threads": 2.5}, 400, None),
    ({"n_ctx": 10}, 400, None),
    ({"kv_type": "q2_k"}, 400, None),
    ({"bogus": 1}, 400, None),
    ({"max_tokens_per_s": -1}, 400, None),
    ({"model": "nope"}, 404, "model_not_found"),
    ({"n_ctx": 4096}, 400, "context_too_large"),  # the ladder's small tier allows 2048
    ({"model": "noflash", "kv_type": "q8_0"}, 400, "unsupported_kv_type"),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD_CONFIG)
def test_bad_config_is_refused_before_touching_the_model(
    engine: Engine, body: dict[str, Any] | bytes, status: int, code: str | None
) -> None:
    before = engine.status()
    r = engine.http.post("/engine/config", content=body) if isinstance(body, bytes) else engine.config(**body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    if code is not None:
        assert r.json()["error"]["code"] == code
    after = engine.status()
    assert after["reloads_total"] == before["reloads_total"]
    assert (after["model"], after["kv_type"], after["n_ctx"]) == (before["model"], before["kv_type"], before["n_ctx"])


def test_a_model_that_fails_to_load_leaves_the_old_one_serving(engine: Engine) -> None:
    r = engine.config(model="broken", kv_type="f16")
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "reload_failed"
    status = engine.status()
    assert (status["model"], status["n_ctx"], status["kv_type"]) == ("small", 2048, "q8_0")
    assert engine.chat(model="small", messages=user("still there?"), max_tokens=2).status_code == 200


def test_unknown_route_and_method_in_openai_shape(engine: Engine) -> None:
    r = engine.http.get("/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = engine.http.get("/v1/chat/completions")
    assert r.status_code == 405
    assert "error" in r.json()


def test_status_fields(engine: Engine) -> None:
    s = engine.status()
    assert s["model"] == "small"
    assert Path(s["model_path"]).name == "demo-small.gguf"
    assert (s["n_ctx"], s["kv_type"], s["threads"]) == (2048, "q8_0", 1)
    assert s["rss_bytes"] > 10 * 1024 * 1024
    assert s["pid"] == engine.proc.pid
    assert s["busy"] is False
    assert s["queue_length"] == 0
    for counter in ("generations_completed", "tokens_generated_total", "prompt_tokens_total", "reloads_total"):
        assert isinstance(s[counter], int)


def test_status_reports_the_context_fill(engine: Engine) -> None:
    """The tokens in the KV cache after an answer: its prompt and the answer (the last sampled token is not evaluated
    until the next turn), which the device model's memory ceiling depends on."""
    r = engine.chat(model="small", messages=user("how full is the context?"), max_tokens=4, ignore_eos=True)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    fill = engine.status()["context_tokens"]
    assert usage["prompt_tokens"] <= fill <= usage["total_tokens"]


def test_full_queue_answers_429(uncapped: Engine) -> None:
    engine = uncapped
    assert engine.config(max_tokens_per_s=5).status_code == 200
    running, running_seen = engine.stream_in_thread({"model": "small", "messages": user("long"), "max_tokens": 400})
    eventually(lambda: engine.status()["busy"])
    waiting = [engine.stream_in_thread({"model": "small", "messages": user("q"), "max_tokens": 2}) for _ in range(2)]
    eventually(lambda: engine.status()["queue_length"] == 2)
    r = engine.chat(model="small", messages=user("one too many"), max_tokens=2)
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    assert engine.status()["rejected_total"] >= 1
    assert engine.config(max_tokens_per_s=None).status_code == 200
    for thread, seen in [(running, running_seen), *waiting]:
        thread.join(60)
        assert seen.done
        assert seen.finish_reason in ("length", "stop")  # random weights may end an answer early


def test_stream_disconnect_cancels(uncapped: Engine) -> None:
    engine = uncapped
    assert engine.config(max_tokens_per_s=10).status_code == 200
    cancelled = engine.status()["generations_cancelled"]
    seen = engine.stream(
        {"model": "small", "messages": user("bye"), "max_tokens": 1000, "ignore_eos": True}, stop_after=3
    )
    assert not seen.done
    eventually(lambda: engine.status()["generations_cancelled"] == cancelled + 1)
    assert engine.status()["busy"] is False


def test_non_stream_disconnect_cancels(uncapped: Engine) -> None:
    engine = uncapped
    assert engine.config(max_tokens_per_s=10).status_code == 200
    cancelled = engine.status()["generations_cancelled"]
    body = json.dumps({"model": "small", "messages": user("bye"), "max_tokens": 1000, "ignore_eos": True}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(engine.socket))
        raw.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        eventually(lambda: engine.status()["busy"])
    eventually(lambda: engine.status()["generations_cancelled"] == cancelled + 1)
    assert engine.status()["busy"] is False
