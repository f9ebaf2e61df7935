"""Malformed requests to the engine's API (through the victim daemon's engine socket; `/engine/config`, which the
public socket refuses, on the engine child's private one): each gets a clean 4xx in the OpenAI error shape, nothing is
loaded into memory that should not be, and the engine keeps serving."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.governor.daemon.daemon_proc import DaemonProc

pytestmark = pytest.mark.slow
FAULT_KIND = "engine API requests"

CHAT = "/v1/chat/completions"
CONFIG = "/engine/config"
OK = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> str:
    return json.dumps({"messages": OK, **fields})


def raw_json(text: str) -> str:
    return text  # Infinity / NaN / 1e400 literals that json.dumps would not write


# (id, method, path, body, expected status)
CASES: list[tuple[str, str, str, str | bytes, int]] = [
    ("empty body", "POST", CHAT, b"", 400),
    ("null", "POST", CHAT, "null", 400),
    ("array", "POST", CHAT, "[]", 400),
    ("truncated JSON", "POST", CHAT, '{"messages": [', 400),
    ("a string", "POST", CHAT, '"hello"', 400),
    ("no messages", "POST", CHAT, "{}", 400),
    ("empty messages", "POST", CHAT, '{"messages": []}', 400),
    ("messages a string", "POST", CHAT, '{"messages": "hi"}', 400),
    ("message without role", "POST", CHAT, '{"messages": [{}]}', 400),
    ("unknown role", "POST", CHAT, '{"messages": [{"role": "wizard", "content": "x"}]}', 400),
    ("content a number", "POST", CHAT, '{"messages": [{"role": "user", "content": 5}]}', 400),
    ("image content", "POST", CHAT, '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400),
    (
        "text part not text",
        "POST",
        CHAT,
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        400,
    ),
    ("content nested lists", "POST", CHAT, '{"messages": [{"role": "user", "content": [[["x"]]]}]}', 400),
    ("max_tokens 0", "POST", CHAT, chat(max_tokens=0), 400),
    ("max_tokens negative", "POST", CHAT, chat(max_tokens=-1), 400),
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="10"), 400),
    ("max_tokens 1e400", "POST", CHAT, raw_json(f'{{"messages": {json.dumps(OK)}, "max_tokens": 1e400}}'), 400),
    ("max_tokens 2**70", "POST", CHAT, chat(max_tokens=2**70), 400),
    ("temperature NaN", "POST", CHAT, raw_json(f'{{"messages": {json.dumps(OK)}, "temperature": NaN}}'), 400),
    ("temperature Infinity", "POST", CHAT, raw_json(f'{{"messages": {json.dumps(OK)}, "temperature": Infinity}}'), 400),
    ("temperature negative", "POST", CHAT, chat(temperature=-1), 400),
    ("temperature a string", "POST", CHAT, chat(temperature="hot"), 400),
    ("top_p 0", "POST", CHAT, chat(top_p=0), 400),
    ("top_p 1.5", "POST", CHAT, chat(top_p=1.5), 400),
    ("top_k negative", "POST", CHAT, chat(top_k=-1), 400),
    ("top_k huge", "POST", CHAT, chat(top_k=10**12), 400),
    (
        "repeat_penalty Infinity",
        "POST",
        CHAT,
        raw_json(f'{{"messages": {json.dumps(OK)}, "repeat_penalty": Infinity}}'),
        400,
    ),
    ("repeat_penalty 0", "POST", CHAT, chat(repeat_penalty=0), 400),
    ("presence_penalty 5", "POST", CHAT, chat(presence_penalty=5), 400),
    (
        "frequency_penalty -Infinity",
        "POST",
        CHAT,
        raw_json(f'{{"messages": {json.dumps(OK)}, "frequency_penalty": -Infinity}}'),
        400,
    ),
    ("min_p 2", "POST", CHAT, chat(min_p=2), 400),
    ("seed negative", "POST", CHAT, chat(seed=-1), 400),
    ("seed 2**40", "POST", CHAT, chat(seed=2**40), 400),
    ("stop a number", "POST", CHAT, chat(stop=5), 400),
    ("five stop sequences", "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400),
    ("n 2", "POST", CHAT, chat(n=2), 400),
    ("stream a string", "POST", CHAT, chat(stream="yes"), 400),
    ("stream_options wrong", "POST", CHAT, chat(stream=True, stream_options={"include_usage": "yes"}), 400),
    ("ignore_eos a string", "POST", CHAT, chat(ignore_eos="true"), 400),
    ("unknown model", "POST", CHAT, chat(model="no-such-model"), 404),
    ("empty model", "POST", CHAT, chat(model=""), 400),
    ("model a number", "POST", CHAT, chat(model=5), 400),
    ("invalid UTF-8", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("deeply nested JSON", "POST", CHAT, "[" * 100_000 + "]" * 100_000, 400),
    ("number 1e99999", "POST", CHAT, '{"messages": 1e99999}', 400),
    ("9 MB body", "POST", CHAT, b'{"messages": "' + b"x" * (9 << 20) + b'"}', 413),
    ("GET on chat", "GET", CHAT, b"", 405),
    ("PUT on chat", "PUT", CHAT, chat(), 405),
    ("config threads 0", "POST", CONFIG, '{"threads": 0}', 400),
    ("config threads 10000", "POST", CONFIG, '{"threads": 10000}', 400),
    ("config threads a string", "POST", CONFIG, '{"threads": "2"}', 400),
    ("config threads 2.5", "POST", CONFIG, '{"threads": 2.5}', 400),
    ("config rate Infinity", "POST", CONFIG, '{"max_tokens_per_s": Infinity}', 400),
    ("config rate NaN", "POST", CONFIG, '{"max_tokens_per_s": NaN}', 400),
    ("config rate 1e-300", "POST", CONFIG, '{"max_tokens_per_s": 1e-300}', 400),
    ("config rate negative", "POST", CONFIG, '{"max_tokens_per_s": -5}', 400),
    ("config rate 1e400", "POST", CONFIG, '{"max_tokens_per_s": 1e400}', 400),
    ("config n_ctx 1e9", "POST", CONFIG, '{"n_ctx": 1000000000}', 400),
    ("config n_ctx 1", "POST", CONFIG, '{"n_ctx": 1}', 400),
    ("config n_ctx over the tier", "POST", CONFIG, '{"n_ctx": 1048576}', 400),
    ("config unknown kv_type", "POST", CONFIG, '{"kv_type": "q2"}', 400),
    ("config unknown model", "POST", CONFIG, '{"model": "nope"}', 404),
    ("config unknown field", "POST", CONFIG, '{"bogus": 1}', 400),
    ("config an array", "POST", CONFIG, "[]", 400),
    ("config not JSON", "POST", CONFIG, "threads=2", 400),
    ("config 100 KB body", "POST", CONFIG, '{"model": "' + "x" * 100_000 + '"}', 413),
    ("unknown path", "GET", "/nope", b"", 404),
    ("POST on status", "POST", "/engine/status", b"{}", 405),
]


def client(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=30.0)


@pytest.fixture(scope="module")
def http(victim: DaemonProc) -> Iterator[httpx.Client]:
    with client(victim.engine_socket) as public:
        yield public


@pytest.fixture(scope="module")
def private(victim: DaemonProc) -> Iterator[httpx.Client]:
    """The engine child's own socket (0600, the daemon's user): where `/engine/config` is answered."""
    with client(victim.engine_socket.with_name("e-child.sock")) as engine:
        yield engine


def check_alive(victim: DaemonProc) -> None:
    victim.check_alive()
    assert victim.engine.status().model  # the engine still answers


@pytest.mark.parametrize("case", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_request_gets_a_clean_4xx(
    http: httpx.Client, private: httpx.Client, victim: DaemonProc, case: tuple[str, str, str | bytes, int]
) -> None:
    method, path, body, expected = case
    on = private if path == CONFIG else http
    answer = on.request(method, path, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == expected, answer.text[:300]
    message = answer.json()["error"]["message"]
    assert message
    assert "\n" not in message
    check_alive(victim)


def test_the_public_socket_refuses_engine_settings(http: httpx.Client, victim: DaemonProc) -> None:
    """A member of the public socket's group must not reconfigure (reload) the engine: 403, and nothing changed."""

    def settings() -> tuple[object, ...]:
        status = victim.engine.status()
        return status.n_ctx, status.threads, (status.model_extra or {})["loads_total"]

    before = settings()
    answer = http.post(CONFIG, json={"n_ctx": 512, "threads": 1})
    assert answer.status_code == 403, answer.text[:300]
    assert "governor's own control" in answer.json()["error"]["message"]
    assert settings() == before
    check_alive(victim)


def test_a_huge_declared_length_is_refused_before_reading(victim: DaemonProc) -> None:
    """50 MB announced, none sent: 413 at once (the engine never waits for, or holds, the body)."""
    answer = raw_http(
        victim.engine_socket, b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: e\r\nContent-Length: 52428800\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    check_alive(victim)


def test_a_chunked_body_over_the_limit_is_refused(http: httpx.Client, victim: DaemonProc) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"messages": "'
        for _ in range(12):
            yield b"x" * (1 << 20)
        yield b'"}'

    answer = http.post(CHAT, content=chunks())
    assert answer.status_code == 413
    check_alive(victim)


@pytest.mark.parametrize(
    "request_bytes",
    [b"HELLO\r\n\r\n", b"GET / HTTP/1.1\r\nHost: e\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n", b"\x00\x01\x02\r\n\r\n"],
    ids=["garbage request line", "200 KB header", "binary request"],
)
def test_broken_http_never_gets_a_5xx(victim: DaemonProc, request_bytes: bytes) -> None:
    answer = raw_http(victim.engine_socket, request_bytes)
    assert not answer.startswith(b"HTTP/1.1 5"), answer[:200]
    check_alive(victim)


def raw_http(path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may close early (e.g. a 413): its answer is what counts
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            # The server closed with our bytes unread (a 431 before the 200 KB header was all read): on a Unix socket
            # the kernel then reports a reset instead of the end of the stream, after the answer queued before it.
            pass
        return out
