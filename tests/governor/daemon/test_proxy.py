"""The public-socket proxy against a scripted engine: what a client receives for whole, broken and odd answers."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import h11
import pytest

from governor.daemon.proxylink import Broken, EngineLink
from governor.daemon.publicsocket import ProxyServer, fast_loop
from governor.daemon.restarts import Availability
from tests.helpers import eventually

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Gate:
    def __init__(self) -> None:
        self.ended: list[bool] = []  # each request's end: whether it was answered

    def availability(self) -> Availability:
        return Availability(ready=True, given_up=False, reason="", retry_after_s=0)

    def request_started(self, *, chat: bool) -> int:
        return 1

    def request_ended(self, start: int, *, answered: bool) -> None:
        self.ended.append(answered)

    def exit_of(self, start: int) -> str | None:
        return "engine killed by SIGSEGV after 1.0 s"


class ScriptedEngine:
    """Answers every request on a Unix socket with `parts`, written one by one, then closes."""

    def __init__(self, path: Path) -> None:
        self.path, self.parts = path, [b""]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            for part in self.parts:
                writer.write(part)
                await writer.drain()
            writer.close()

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            async with await asyncio.start_unix_server(handle, str(self.path)):
                self._ready.set()
                await self._stop.wait()

        asyncio.run(main())

    def close(self) -> None:
        assert self._loop is not None
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)


@pytest.fixture(params=["asyncio", "uvloop"])
def proxied(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ScriptedEngine, Path]]:
    """The proxy on asyncio's own event loop and on uvloop (used when installed: publicsocket.fast_loop)."""
    monkeypatch.setenv("GOVERNOR_PROXY_LOOP", request.param)
    engine = ScriptedEngine(tmp_path / "e-child.sock")
    proxy = ProxyServer(tmp_path / "e.sock", engine.path, Gate(), hold_s=1.0, drain_s=1)
    proxy.start()
    yield engine, tmp_path / "e.sock"
    proxy.close(5.0)
    engine.close()


def ask(public: Path, recv_bytes: int = 65536, target: str = "/v1/chat/completions") -> tuple[int, bytes]:
    """POST a chat request (or `target`) through the proxy; the status and the (de-chunked) body the client got (read
    `recv_bytes` at a time)."""
    conn = h11.Connection(h11.CLIENT)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(public))
        head = [(b"host", b"x"), (b"content-length", b"2"), (b"connection", b"close")]
        sock.sendall(conn.send(h11.Request(method="POST", target=target, headers=head)))
        sock.sendall(conn.send(h11.Data(data=b"{}")) + conn.send(h11.EndOfMessage()))
        status, body = 0, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(recv_bytes))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, body


def test_a_streamed_answer_arrives_whole_and_in_order(proxied: tuple[ScriptedEngine, Path]) -> None:
    engine, public = proxied
    events = [b'data: {"n": %d}\n\n' % i for i in range(20)] + [b"data: [DONE]\n\n"]
    engine.parts = [SSE_HEAD, *(chunk(e) for e in events), b"0\r\n\r\n"]
    assert ask(public) == (200, b"".join(events))


@pytest.mark.parametrize(
    "target", ["/engine/pause", "/engine/pause/", "/engine/config", "/%65ngine/config", "/engine/config#x"]
)
def test_the_public_socket_does_not_pass_on_the_engines_controls(
    proxied: tuple[ScriptedEngine, Path], target: str
) -> None:
    engine, public = proxied
    engine.parts = [SSE_HEAD, chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"]  # what a passed-on request would get
    status, body = ask(public, target=target)
    assert status == 403
    assert b"governor's own control" in body


def test_informational_answers_are_skipped(proxied: tuple[ScriptedEngine, Path]) -> None:
    engine, public = proxied
    engine.parts = [b"HTTP/1.1 100 Continue\r\n\r\n", SSE_HEAD, chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"]
    assert ask(public) == (200, b"data: [DONE]\n\n")


def test_a_stream_cut_short_ends_with_an_error_event_and_done(proxied: tuple[ScriptedEngine, Path]) -> None:
    engine, public = proxied
    engine.parts = [SSE_HEAD, chunk(b'data: {"n": 0}\n\n')]  # then the engine dies
    status, body = ask(public)
    assert status == 200
    first, error, done = body.split(b"\n\n")[:3]
    assert first == b'data: {"n": 0}'
    assert b"engine_died" in error
    assert b"SIGSEGV" in error
    assert done == b"data: [DONE]"


def test_a_json_answer_cut_short_is_a_502_not_half_a_json(proxied: tuple[ScriptedEngine, Path]) -> None:
    engine, public = proxied
    engine.parts = [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n", b'{"id": "x"']
    status, body = ask(public)
    assert status == 502
    assert b"engine_died" in body
    assert b'"id"' not in body


@pytest.mark.parametrize(
    ("parts", "answered"),
    [
        ([SSE_HEAD, chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"], True),
        ([SSE_HEAD, chunk(b'data: {"n": 0}\n\n')], False),  # the stream cut short
        ([b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", b'{"id"'], False),  # the JSON cut short
    ],
    ids=["whole", "stream cut short", "json cut short"],
)
def test_the_gate_hears_every_chat_end_and_whether_it_was_answered(
    tmp_path: Path, parts: list[bytes], answered: bool
) -> None:
    """An external server's busy count goes down by each chat's end, the broken ones too (they leaked: a server that
    once broke under an answer was busy forever); the supervisor counts only the answered ones."""
    engine, gate = ScriptedEngine(tmp_path / "e-child.sock"), Gate()
    engine.parts = parts
    proxy = ProxyServer(tmp_path / "e.sock", engine.path, gate, hold_s=1.0, drain_s=1)
    proxy.start()
    try:
        ask(tmp_path / "e.sock")
        assert eventually(lambda: gate.ended) == [answered]
    finally:
        proxy.close(5.0)
        engine.close()


def test_garbage_from_the_engine_is_a_502(proxied: tuple[ScriptedEngine, Path]) -> None:
    engine, public = proxied
    engine.parts = [b"SMTP ready\r\n\r\n"]
    status, body = ask(public)
    assert status == 502
    assert b"engine_died" in body


def test_a_slow_client_gets_every_byte_in_order(proxied: tuple[ScriptedEngine, Path]) -> None:
    """More than the socket buffers hold: the proxy has to wait for the client (flow control) while relaying."""
    engine, public = proxied
    events = [b'data: {"n": %d, "pad": "%s"}\n\n' % (i, b"x" * 4000) for i in range(300)]
    engine.parts = [SSE_HEAD, *(chunk(e) for e in events), b"0\r\n\r\n"]
    assert ask(public, recv_bytes=4096) == (200, b"".join(events))


def relay_through(path: Path, forward: Callable[[list[bytes]], Awaitable[None]]) -> list[bytes]:
    """Run one request on `path` and relay its body through `forward` (given what came so far); what it was given."""
    got: list[bytes] = []

    async def main() -> None:
        link = EngineLink(path)
        await link.send(b"POST", b"/v1/chat/completions", [], b"{}")
        assert (await link.head())[0] == 200

        async def each(data: bytes) -> None:
            got.append(data)
            await forward(got)

        try:
            await link.relay(each)
        finally:
            link.close()

    asyncio.run(main())
    return got


def test_relay_finishes_a_piece_that_had_to_wait_before_the_next_one(tmp_path: Path) -> None:
    engine = ScriptedEngine(tmp_path / "e.sock")
    events = [b"data: %d\n\n" % i for i in range(300)]
    engine.parts = [SSE_HEAD, *(chunk(e) for e in events), b"0\r\n\r\n"]
    running = 0
    most = 0

    async def forward(got: list[bytes]) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        for _ in range(3 if len(got) % 2 else 0):  # every other piece waits a few turns, as a send to a full socket
            await asyncio.sleep(0)
        await asyncio.sleep(0.001 if len(got) == 2 else 0)  # and one waits for a timer (a future)
        running -= 1

    try:
        got = relay_through(engine.path, forward)
    finally:
        engine.close()
    assert b"".join(got) == b"".join(events)
    assert most == 1  # a piece is never handed on while the one before it still waits


def test_relay_raises_broken_after_handing_on_what_came(tmp_path: Path) -> None:
    engine = ScriptedEngine(tmp_path / "e.sock")
    engine.parts = [SSE_HEAD, chunk(b"data: 0\n\n"), chunk(b"data: 1\n\n")]  # then the engine closes mid-answer

    async def forward(got: list[bytes]) -> None:
        await asyncio.sleep(0)

    try:
        with pytest.raises(Broken, match="closed the connection"):
            relay_through(engine.path, forward)
    finally:
        engine.close()


def test_a_failing_forward_fails_the_relay(tmp_path: Path) -> None:
    engine = ScriptedEngine(tmp_path / "e.sock")
    engine.parts = [SSE_HEAD, chunk(b"data: 0\n\n"), chunk(b"data: 1\n\n"), b"0\r\n\r\n"]

    async def forward(got: list[bytes]) -> None:
        raise RuntimeError("the client's side is gone")

    try:
        with pytest.raises(RuntimeError, match="gone"):
            relay_through(engine.path, forward)
    finally:
        engine.close()


def test_the_proxy_runs_on_uvloop_when_installed_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvloop

    monkeypatch.delenv("GOVERNOR_PROXY_LOOP", raising=False)
    assert fast_loop() is uvloop.new_event_loop
    monkeypatch.setenv("GOVERNOR_PROXY_LOOP", "asyncio")
    assert fast_loop() is None
