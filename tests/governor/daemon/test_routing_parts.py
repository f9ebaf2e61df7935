"""Routing's parts without processes: the upstream config, API keys, request parsing, and answers marked with
where they ran (governor/daemon/config.py, routing.py, upstream.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from governor.daemon.config import ConfigError, load_config
from governor.daemon.publicsocket import ProxyServer
from governor.daemon.restarts import Availability
from governor.daemon.routing import Router, RoutingError, UpstreamLink, build_router, chat_info, read_key
from governor.daemon.upstream import first_token_seen, mark_first_event, mark_json
from policies.decision import Decision, EngineConfig, State
from tests.governor.daemon.test_proxy import SSE_HEAD, Gate, ScriptedEngine, chunk
from tests.policies.conftest import make_policy

READY = Availability(True, False, "", 0)


HI = {"messages": [{"role": "user", "content": "hi"}]}


def post_chat(sock: Path, body: dict[str, Any]) -> httpx.Response:
    """One chat request through the proxy's public socket, as a client would send it."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=10) as http:
        return http.post("/v1/chat/completions", json=body)


@contextmanager
def proxy_for(tmp_path: Path, engine: Path, gate: Gate, router: Router | None = None) -> Iterator[Path]:
    """The daemon's proxy in front of `engine`, on tmp_path/e.sock (yielded), closed afterwards."""
    proxy = ProxyServer(tmp_path / "e.sock", engine, gate, hold_s=1.0, drain_s=1, router=router)
    proxy.start()
    try:
        yield tmp_path / "e.sock"
    finally:
        proxy.close(5.0)


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "governor.toml"
    path.write_text(text)
    return path


def test_upstreams_load_sorted_by_order(tmp_path: Path) -> None:
    cfg = load_config(
        config(
            tmp_path,
            '[[upstream]]\nname = "cloud"\nbase_url = "https://api.example.com/v1/"\norder = 2\n'
            '[[upstream]]\nname = "lan"\nbase_url = "http://localhost/v1"\nsocket = "/run/up.sock"\n'
            'models = { large = "llama-70b" }\n',
        )
    )
    assert [u.name for u in cfg.upstream] == ["lan", "cloud"]
    assert cfg.upstream[1].base_url == "https://api.example.com/v1"
    assert load_config(config(tmp_path, "")).upstream == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "x"\nbase_url = "ftp://host/v1"', "an http:// or https:// URL"),
        ('name = "x"\nbase_url = "http://u:p@host/v1"', "not in the URL"),
        ('name = "x"\nbase_url = "http://h/v1"\napi_key_file = "/k"\napi_key_env = "K"', "not both"),
        ('name = "x"\nbase_url = "http://h/v1"\ntimeout_s = nan', "upstream.0.timeout_s"),
        ('name = "x"\nbase_url = "http://h/v1"\nkey = "sk-1"', "upstream.0.key"),
        ('name = "a b"\nbase_url = "http://h/v1"', "upstream.0.name"),
    ],
)
def test_a_bad_upstream_is_one_line_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config(config(tmp_path, f"[[upstream]]\n{text}\n"))
    assert "\n" not in str(err.value)


def test_two_upstreams_of_one_name_are_refused(tmp_path: Path) -> None:
    text = '[[upstream]]\nname = "a"\nbase_url = "http://h/v1"\n' * 2
    with pytest.raises(ConfigError, match="two upstreams named 'a'"):
        load_config(config(tmp_path, text))


def test_the_key_comes_from_a_file_or_the_environment_and_never_shows(tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_text("sk-SECRET\n")
    cfg = load_config(
        config(
            tmp_path,
            f'[[upstream]]\nname = "a"\nbase_url = "http://h/v1"\napi_key_file = "{key}"\n'
            '[[upstream]]\nname = "b"\nbase_url = "http://h/v1"\napi_key_env = "B_KEY"\n',
        )
    )
    assert read_key(cfg.upstream[0], {}) == "sk-SECRET"
    assert read_key(cfg.upstream[1], {"B_KEY": "sk-ENV"}) == "sk-ENV"
    with pytest.raises(RoutingError, match="environment variable B_KEY is not set"):
        read_key(cfg.upstream[1], {})
    router = build_router(cfg.upstream, {"B_KEY": "sk-ENV"}, policy=lambda: None, engine_status=lambda: None)
    shown = json.dumps(router.status()) + repr(router.upstreams) + str(cfg)
    assert "sk-SECRET" not in shown
    assert "sk-ENV" not in shown
    link = router.upstreams[0]
    assert link.auth_headers() == [(b"authorization", b"Bearer sk-SECRET")]
    assert link.scrub("bad key sk-SECRET") == "bad key ***"
    key.unlink()
    with pytest.raises(RoutingError, match=f"upstream a: api_key_file {key}: No such file"):
        build_router(cfg.upstream, {"B_KEY": "x"}, policy=lambda: None, engine_status=lambda: None)


def test_routing_is_off_until_an_upstream_is_configured() -> None:
    router = build_router((), {}, policy=lambda: None, engine_status=lambda: None)
    route = router.choose(chat_info(b'{"messages": []}'), Availability(False, True, "given up", 5))
    assert (route.label, route.kind) == ("local", "routing_off")


def test_local_only_and_the_engine_down(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, '[[upstream]]\nname = "lan"\nbase_url = "http://h/v1"\nmodel = "big"\n'))
    status = {"queue_length": 0, "queue_max": 2}
    router = build_router(cfg.upstream, {}, policy=lambda: None, engine_status=lambda: status)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "governor": {"local_only": true}}'
    info = chat_info(body)
    assert info.local_only
    assert b"governor" not in info.body  # the engine (and an upstream) never see our field
    assert router.choose(info, READY).kind == "local_only"
    plain = chat_info(b'{"messages": [{"role": "user", "content": "hi"}]}')
    header = chat_info(plain.body, [(b"X-Governor-Local-Only", b"1")])
    assert router.choose(header, READY).kind == "local_only"
    down = router.choose(plain, Availability(False, False, "the engine is loading", 2))
    assert (down.label, down.kind, down.reason) == ("upstream:lan", "engine_unavailable", "the engine is loading")
    status["queue_length"] = 2
    assert router.choose(plain, READY).kind == "queue_full"
    router.failed(router.upstreams[0], phase="before_first_token", error="refused")
    fallback = router.choose(plain, READY)
    assert (fallback.label, fallback.kind) == ("local", "no_upstream")


def test_the_model_map() -> None:
    from governor.daemon.config import Upstream

    mapped = UpstreamLink(Upstream(name="a", base_url="http://h/v1", models={"large": "70b", "small": "8b"}), None)
    assert mapped.model_for("small", "large") == "8b"
    assert mapped.model_for(None, "large") == "70b"
    assert mapped.model_for("other", None) == "other"
    fixed = UpstreamLink(Upstream(name="b", base_url="http://h/v1", model="gpt-x"), None)
    assert fixed.model_for("large", "large") == "gpt-x"


def test_answers_are_marked_where_they_ran() -> None:
    fields = {"route": "local", "why": "meets"}
    whole = json.loads(mark_json(b'{"id": "c", "governor": {"trimmed_messages": 1}}', fields))
    assert whole["governor"] == {"trimmed_messages": 1, "route": "local", "why": "meets"}
    assert mark_json(b"not json", fields) == b"not json"
    opening = b'data: {"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    token = b'data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
    assert not first_token_seen(opening)
    assert not first_token_seen(opening + token[:20])
    assert first_token_seen(opening + token)
    assert first_token_seen(b"data: [DONE]\n\n")
    marked = mark_first_event(opening + token, fields)
    first, rest = marked.split(b"\n\n", 1)
    assert json.loads(first[6:])["governor"] == fields
    assert rest == token


def test_a_long_prompt_goes_upstream_once_the_devices_prefill_speed_is_measured(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, '[[upstream]]\nname = "lan"\nbase_url = "http://h/v1"\n'))
    policy = make_policy(slo={"max_ttft_s": 1.0})
    status: dict[str, object] = {"threads": 4, "busy": False, "queue_length": 0}
    router = build_router(cfg.upstream, {}, policy=lambda: policy, engine_status=lambda: status)
    engine = EngineConfig(threads=4, n_ctx=1024, model="large")
    router.on_tick(0.0, None, None, Decision(t=0.0, state=State.IDLE, engine=engine, reason="", rule=""))  # type: ignore[arg-type]
    short = chat_info(json.dumps({"messages": [{"role": "user", "content": "x" * 400}]}).encode())
    long = chat_info(json.dumps({"messages": [{"role": "user", "content": "x" * 4000}]}).encode())
    assert router.choose(long, READY).kind == "meets"  # no prefill measured yet
    router.local_ttft(short.prompt_tokens, 0.5, idle=True)  # ~105 tokens in 0.5 s
    assert router.status()["measured"]["prefill_tokens_per_s"] == pytest.approx(210, rel=0.05)
    assert router.choose(short, READY).kind == "meets"
    route = router.choose(long, READY)
    assert (route.label, route.kind) == ("upstream:lan", "ttft")
    assert "predicted TTFT" in route.reason


def test_every_chat_answer_says_where_it_ran_even_with_routing_off(tmp_path: Path) -> None:
    engine = ScriptedEngine(tmp_path / "e-child.sock")
    engine.parts = [SSE_HEAD, chunk(b'data: {"choices":[]}\n\n'), b"0\r\n\r\n"]
    try:
        with proxy_for(tmp_path, engine.path, Gate()) as sock:
            r = post_chat(sock, {"messages": [], "governor": {"local_only": True}})
        assert r.headers["x-governor-route"] == "local"
        assert "governor" not in r.text  # routing off: the engine's answer unchanged
    finally:
        engine.close()


def test_an_engine_answering_queue_full_hands_the_request_to_the_upstream(tmp_path: Path) -> None:
    full = b'{"error": {"message": "the engine\'s queue is full", "code": "queue_full"}}'
    engine = ScriptedEngine(tmp_path / "e-child.sock")
    engine.parts = [
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n",
        b"content-length: %d\r\n\r\n%s" % (len(full), full),
    ]
    answer = b'{"model": "big", "choices": [{"message": {"content": "Paris"}}]}'
    upstream = ScriptedEngine(tmp_path / "up.sock")
    upstream.parts = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer)
    ]
    cfg = load_config(
        config(tmp_path, f'[[upstream]]\nname = "lan"\nbase_url = "http://up/v1"\nsocket = "{upstream.path}"\n')
    )
    router = build_router(cfg.upstream, {}, policy=lambda: None, engine_status=lambda: None)
    try:
        with proxy_for(tmp_path, engine.path, Gate(), router) as sock:
            r = post_chat(sock, HI)
            local = post_chat(sock, {"messages": [], "governor": {"local_only": True}})
        assert r.status_code == 200
        assert r.headers["x-governor-route"] == "upstream:lan"
        assert r.json()["governor"] == {"route": "upstream:lan", "why": "the engine answered that its queue is full"}
        assert local.status_code == 429  # may not leave the device: the engine's answer as it is
        assert local.headers["x-governor-route"] == "local"
        assert [r["kind"] for r in router.recent(10)] == ["meets", "queue_full", "local_only"]
    finally:
        engine.close()
        upstream.close()


def test_a_background_request_stays_on_a_device_that_misses_only_the_interactive_target(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, '[[upstream]]\nname = "lan"\nbase_url = "http://h/v1"\n'))
    policy = make_policy(slo={"min_tokens_per_s": 8.0, "background": {"min_tokens_per_s": 2.0}})
    router = build_router(cfg.upstream, {}, policy=lambda: policy, engine_status=lambda: {})
    hot = EngineConfig(threads=2, n_ctx=1024, model="large", max_tokens_per_s=5.0)
    router.on_tick(0.0, None, None, Decision(t=0.0, state=State.HOT, engine=hot, reason="", rule=""))  # type: ignore[arg-type]
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    assert router.choose(chat_info(body), READY).kind == "slo"
    background = chat_info(body, [(b"x-governor-class", b"background")])
    assert background.background
    assert router.choose(background, READY).kind == "meets"
    in_body = chat_info(b'{"messages": [], "governor": {"class": "background"}}')
    assert in_body.background
    assert b"governor" not in in_body.body


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": 1e99999}',
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        b'{"messages": [5, null, {"content": {"a": 1}}], "prompt": ["x"], "model": 3, "governor": 7}',
        b"[1, 2]",
        b"not json",
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_any_body_is_read_without_failing_and_left_to_the_engine_to_judge(body: bytes) -> None:
    info = chat_info(body)
    assert not info.local_only
    assert info.prompt_tokens >= 0


def test_status_shows_routing_and_upstream_health_safely() -> None:
    from rich.console import Console

    from governor.daemon.render import status_table

    routing = {
        "enabled": True,
        "off_device": True,
        "reason": "hot: rate cap 1 tok/s < target 3 tok/s",
        "slo": {"min_tokens_per_s": 3.0, "max_ttft_s": 2.0},
        "upstreams": [
            {"name": "lan", "base_url": "http://h/v1", "healthy": False, "retry_in_s": 12.0, "requests": 4,
             "errors": 1, "last_error": "before first token: HTTP 500: [/] \x1b[2J"},
        ],
        "last": [{"wall": 0.0, "route": "upstream:lan", "reason": "the device cannot meet the target"}],
    }  # fmt: skip
    console = Console(record=True, width=200)
    status_table({"state": "hot", "routing": routing}, console, now=0.0)
    text = console.export_text()
    assert "off the device (hot: rate cap 1 tok/s < target 3 tok/s); targets ≥ 3 tok/s, TTFT ≤ 2 s" in text
    assert "http://h/v1: skipped for 12.0 s, 4 requests, 1 errors; last error before first token: HTTP 500: [/]" in text
    assert "\x1b[2J" not in text
    assert re.search(r"last request +upstream:lan: the device cannot meet the target", text)


def test_an_upstream_failing_before_its_first_token_hands_the_request_to_the_next_one(tmp_path: Path) -> None:
    engine = ScriptedEngine(tmp_path / "e-child.sock")  # never asked: the engine is down
    broken = ScriptedEngine(tmp_path / "a.sock")
    broken.parts = [b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\noops"]
    answer = b'{"model": "big", "choices": [{"message": {"content": "Paris"}}]}'
    good = ScriptedEngine(tmp_path / "b.sock")
    good.parts = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer)
    ]
    text = "".join(
        f'[[upstream]]\nname = "{n}"\nbase_url = "http://{n}/v1"\nsocket = "{p}"\norder = {o}\n'
        for n, p, o in (("a", broken.path, 0), ("b", good.path, 1))
    )
    router = build_router(load_config(config(tmp_path, text)).upstream, {}, policy=lambda: None, engine_status=dict)

    class Down(Gate):
        def availability(self) -> Availability:
            return Availability(ready=False, given_up=True, reason="the engine was given up", retry_after_s=60)

    try:
        with proxy_for(tmp_path, engine.path, Down(), router) as sock:
            r = post_chat(sock, HI)
        assert r.status_code == 200
        assert r.headers["x-governor-route"] == "upstream:b"
        why = r.json()["governor"]["why"]
        assert why.startswith("upstream a failed before the first token (HTTP 500: oops); trying upstream b: ")
        assert [(u["name"], u["errors"], u["requests"]) for u in router.status()["upstreams"]] == [
            ("a", 1, 1),
            ("b", 0, 1),
        ]
    finally:
        for server in (engine, broken, good):
            server.close()
