"""The public chat socket: a thin streaming reverse proxy in front of the engine child's private socket.

Clients keep the engine socket path they always used; the daemon holds it, so an engine that is starting, restarting,
crashing or given up is an HTTP answer, never a reset connection or an empty reply:

- starting or restarting: the request waits up to `hold_s` for the engine, then gets 503 with the reason and
  Retry-After (the back-off left plus the last load time);
- given up (crash loop) or the daemon stopping: 503 at once, with the supervisor's reason;
- the engine dies under a request: a non-streamed one gets a 502 OpenAI-shaped error (its body is read whole before
  anything is sent, so a half-sent JSON cannot look complete); a streamed one gets `data: {"error": {...}}` and
  `data: [DONE]` before the stream ends -- a truncated stream never looks finished.

Bytes are forwarded as they arrive (no per-chunk parsing of their content): a raw ASGI app on uvicorn, on its own
thread and event loop, and one asyncio stream per request to the private socket, its answer parsed by httptools
(httpx's Unix socket streams re-register the socket with epoll at every read, which tripled the per-token cost). A
request that never reached the engine (connect refused while it restarts) is sent again to the next engine, within the
same hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import os
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol

import h11
import httptools
import structlog
import uvicorn

from govbase.errors import GovernorError
from governor import unixsock
from governor.daemon.supervisor import Availability

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
UpstreamRequest = tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]  # method, target, headers, body

POLL_S = 0.05  # how often a held request looks at the engine's availability
DEATH_WAIT_S = 3.0  # after the upstream connection broke, how long to wait for the supervisor's word on why
MAX_BODY = 16 * 2**20  # the proxy's own bound (the engine's limits per path are lower and answer for themselves)
READ_CHUNK = 64 * 2**10
CHAT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",  # uvicorn answers 100-continue to the client; the body goes upstream in one piece
    }
)


class ProxyError(GovernorError):
    pass


class _TooLarge(Exception):
    pass


class EngineGate(Protocol):
    """What the proxy needs from the supervisor (governor.daemon.supervisor.EngineSupervisor)."""

    def availability(self) -> Availability: ...
    def request_started(self, *, chat: bool) -> int: ...
    def request_ended(self, start: int) -> None: ...
    def exit_of(self, start: int) -> str | None: ...


def error_body(message: str, code: str) -> bytes:
    """The OpenAI error shape, as the engine itself answers it (governor.engine.app.error)."""
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}).encode()


async def _send_error(send: Send, status: int, message: str, code: str, retry_after_s: int | None = None) -> None:
    body = error_body(message, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _forwarded(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in headers if k.lower() not in HOP_BY_HOP]


async def _disconnected(receive: Receive) -> None:
    """Returns when the client goes away (or the response is complete: uvicorn then answers http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Upstream:
    """One HTTP/1.1 exchange with the engine on its Unix socket: an asyncio stream (the socket stays registered with
    the loop, so a token costs one read), h11 to frame the request and httptools (C, llhttp) to parse the answer: h11's
    pure-Python chunk parser was 40 % of the proxy's CPU per token (issue 16). Every body piece that arrived by one
    read is handed on as one: a client that fell behind gets the tokens that piled up in one chunk. A fresh
    connection per request: connecting to a local socket costs microseconds, and a dead engine's connections never
    need weeding out of a pool."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = False  # an answer to HEAD has no body, whatever its content-length says
        self._headers: list[tuple[bytes, bytes]] = []
        self._status: int | None = None
        self._body: list[bytes] = []
        self._complete = False

    async def send(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Raises OSError (refused, missing) before anything reached the engine."""
        self._reader, self._writer = await asyncio.open_unix_connection(str(self.path), limit=READ_CHUNK)
        self._head_only = method == b"HEAD"
        conn = h11.Connection(h11.CLIENT)
        head = [(b"host", b"engine"), *headers, (b"content-length", str(len(body)).encode())]
        data = conn.send(h11.Request(method=method, target=target, headers=head))
        data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        self._writer.write(data)
        await self._writer.drain()

    # httptools' callbacks. An informational answer (1xx) comes and completes before the real one: skipped.
    def on_message_begin(self) -> None:
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status >= 200:
            self._status = status
            self._complete = self._head_only

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._status is not None:
            self._complete = True

    async def _read(self) -> None:
        """Feed the parser the next bytes; raises `_Broken` when the engine's side closed or broke first."""
        assert self._reader is not None
        try:
            data = await self._reader.read(READ_CHUNK)
        except OSError as exc:
            raise _Broken(str(exc)) from exc
        if not data:
            raise _Broken("the engine closed the connection")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise _Broken(f"bad answer from the engine: {exc}") from exc

    async def head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        while self._status is None:
            await self._read()
        return self._status, self._headers

    async def body(self) -> bytes | None:
        """The body bytes that arrived since the last call (waiting for some), or None after the last."""
        while not self._body and not self._complete:
            await self._read()
        if not self._body:
            return None
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        return data

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()  # mid-answer, this is how the engine learns the client left


class _Broken(Exception):
    """The engine's connection closed or broke before its answer was complete."""


class ProxyApp:
    """The ASGI app: every request on the public socket goes to the engine's private socket, or gets a clear 5xx."""

    def __init__(self, upstream: Path, gate: EngineGate, *, hold_s: float) -> None:
        self.upstream, self.gate, self.hold_s = upstream, gate, hold_s
        self._log = structlog.get_logger("governor.proxy")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _body(self, receive: Receive) -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > MAX_BODY:
                raise _TooLarge
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        try:
            if not declared.isdigit() or int(declared) > MAX_BODY:
                raise _TooLarge  # refused before reading: a 50 MB body never sits in the daemon's memory
            body = await self._body(receive)
        except _TooLarge:
            await _send_error(send, 413, f"request body larger than {MAX_BODY} bytes", "body_too_large")
            return
        if body is None:
            return  # the client left before it finished sending
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        request = (scope["method"].encode(), target, _forwarded(scope["headers"]), body)
        chat = scope["method"] == "POST" and scope["path"] in CHAT_PATHS
        sent = asyncio.Event()  # the whole answer went to the client
        work = asyncio.ensure_future(self._exchange(request, chat, send, sent))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and not sent.is_set():
                # The client left: dropping the upstream connection makes the engine cancel the answer.
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        finally:
            gone.cancel()

    async def _exchange(
        self,
        request: tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes],
        chat: bool,
        send: Send,
        sent: asyncio.Event,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_s
        while True:
            avail = self.gate.availability()
            if avail.given_up or (not avail.ready and loop.time() >= deadline):
                code = "engine_unavailable" if avail.given_up else "engine_starting"
                await _send_error(send, 503, avail.reason, code, avail.retry_after_s)
                return
            if not avail.ready:
                await asyncio.sleep(POLL_S)
                continue
            start = self.gate.request_started(chat=chat)
            upstream = _Upstream(self.upstream)
            try:
                await upstream.send(*request)
            except OSError:
                # It never reached the engine (which just died or is not listening yet): hold it for the next one.
                upstream.close()
                if chat:
                    self.gate.request_ended(start)
                await asyncio.sleep(POLL_S)
                continue
            except asyncio.CancelledError:
                upstream.close()
                if chat:
                    self.gate.request_ended(start)  # the client left; the engine did nothing wrong
                raise
            break
        whole = False
        try:
            whole = await self._forward(upstream, send, start)
            sent.set()
        except asyncio.CancelledError:
            whole = True
            raise
        finally:
            upstream.close()
            if chat and whole:
                self.gate.request_ended(start)

    async def _forward(self, upstream: _Upstream, send: Send, start: int) -> bool:
        """Relay the engine's answer; True when it was relayed whole, False when the engine died under it."""
        try:
            status, head_headers = await upstream.head()
        except _Broken as exc:
            await _send_error(send, 502, await self._died(start, exc), "engine_died", self._retry_after())
            return False
        headers = _forwarded(head_headers)
        streamed = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        if not streamed:  # read whole before sending: a truncated JSON must never look like a complete one
            parts: list[bytes] = []
            try:
                while (data := await upstream.body()) is not None:
                    parts.append(data)
            except _Broken as exc:
                await _send_error(send, 502, await self._died(start, exc), "engine_died", self._retry_after())
                return False
            content = b"".join(parts)
            headers.append((b"content-length", str(len(content)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content, "more_body": False})
            return True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        try:
            while (data := await upstream.body()) is not None:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except _Broken as exc:
            error = b"data: " + error_body(await self._died(start, exc), "engine_died") + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": error, "more_body": False})
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    async def _died(self, start: int, exc: Exception) -> str:
        """'the engine died while answering: engine killed by SIGSEGV after 3.1 s, in the first decode; ...'"""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEATH_WAIT_S
        why = self.gate.exit_of(start)
        while why is None and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
            why = self.gate.exit_of(start)
        self._log.warning("engine connection broke under a request", error=str(exc), why=why)
        return f"the engine died while answering: {why or f'connection lost ({exc})'}"

    def _retry_after(self) -> int:
        return self.gate.availability().retry_after_s or 1


class _QuietServer(uvicorn.Server):
    """uvicorn's main loop wakes every 0.1 s to look at `should_exit`: ten wake-ups a second of an idle daemon
    (issue 16). This one sleeps until `stop()` (any thread) wakes it."""

    _loop: asyncio.AbstractEventLoop | None = None
    _exit: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._exit = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if await self.on_tick(0):  # the default headers, once; True when stop() came first
            return
        await self._exit.wait()

    def stop(self) -> None:
        self.should_exit = True
        loop, event = self._loop, self._exit
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(event.set)


class ProxyServer:
    """The public socket, bound at once (so a bad path is a one-line error at start), served on its own thread."""

    def __init__(
        self,
        path: Path,
        upstream: Path,
        gate: EngineGate,
        *,
        hold_s: float,
        drain_s: int,
        group: str | None = None,
    ) -> None:
        self.path = path
        if len(os.fsencode(path)) >= 108 or len(os.fsencode(upstream)) >= 108:
            raise ProxyError(f"{path}: a Unix socket path must be shorter than 108 bytes (with its -child twin)")
        try:
            gid = grp.getgrnam(group).gr_gid if group else -1
        except KeyError:
            raise ProxyError(f"engine socket group {group!r} does not exist") from None
        self._sock = unixsock.bind_unix(
            path, 0o660 if group else 0o600, lambda reason: ProxyError(f"engine socket {path}: {reason}")
        )
        if group:
            os.chown(path, -1, gid)
        self._sock.listen(128)  # connections wait in the backlog until uvicorn runs: never refused once it exists
        self._inode = os.stat(path).st_ino
        self.app = ProxyApp(upstream, gate, hold_s=hold_s)
        config = uvicorn.Config(
            self.app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            server_header=False,  # the engine's own headers pass through
            date_header=False,
            timeout_graceful_shutdown=drain_s,  # then uvicorn cancels what still runs
        )
        self._server = _QuietServer(config)
        self._thread = threading.Thread(target=self._serve, name="engine-proxy", daemon=True)

    def _serve(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        """uvicorn closes the listener, then lets running answers finish (up to drain_s) while the engine drains."""
        self._server.stop()
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:
                self.path.unlink()

    def close(self, timeout_s: float) -> None:
        self.stop_accepting()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()
