"""The proxy's parts (governor.daemon.proxy): the HTTP/1.1 link to the engine child's private socket (or an
upstream), framed per RFC 9112 with bounded heads, and the error answers."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from pathlib import Path
from typing import Any, cast

import h11
import httptools

READ_CHUNK = 64 * 2**10
MAX_HEAD = 64 * 2**10  # an answer's status line and headers; past it the answer is broken, not buffered
ROUTE_HEADER = b"x-governor-route"  # every chat answer says where it ran: local or upstream:NAME
LOCAL_ONLY_HEADER = b"x-governor-local-only"  # a request's opt-out of routing (docs/routing.md)
CLASS_HEADER = b"x-governor-class"  # "background": judged against the policy's [slo.background]
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

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def error_body(message: str, code: str) -> bytes:
    """The OpenAI error shape, as the engine itself answers it (governor.engine.httpio.error)."""
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}).encode()


LOCAL = [(ROUTE_HEADER, b"local")]  # every chat answer says where it ran


async def send_error(
    send: Send, status: int, message: str, code: str, retry_after_s: int | None = None, *, chat: bool = False
) -> None:
    body = error_body(message, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if chat:
        headers += LOCAL
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def forwarded(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in headers if k.lower() not in HOP_BY_HOP]


async def disconnected(receive: Receive) -> None:
    """Returns when the client goes away (or the response is complete: uvicorn then answers http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EngineLink(asyncio.BufferedProtocol):
    """One HTTP/1.1 exchange with the engine on its Unix socket: h11 frames the request and httptools (C, llhttp)
    parses the answer straight from the read callback: h11's pure-Python chunk parser was 40 % of the proxy's CPU per
    token (issue 16). The connection is a protocol rather than an asyncio stream: bytes land in one reused buffer
    (no 256 KiB allocation per read) and are parsed at once, so the task waiting for the answer is woken only when
    there is body to hand on, and `relay()` hands a streamed body on from the read callback itself: one event-loop
    turn per token instead of two (the read, then the task). Every body piece that arrived by one read is handed on
    as one: a client that fell behind gets the tokens that piled up in one chunk. A fresh connection per request:
    connecting to a local socket costs microseconds, and a dead engine's connections never need weeding out of a
    pool."""

    def __init__(self, path: Path | None, *, address: tuple[str, int] | None = None, host: bytes = b"engine") -> None:
        """`path`: a Unix socket; else `address` (host, port) over TCP (TLS with `tls`); `host`: the Host header."""
        self.path, self.address, self.host = path, address, host
        self.tls: ssl.SSLContext | None = None
        self._transport: asyncio.Transport | None = None
        self._buffer = memoryview(bytearray(READ_CHUNK))
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = False  # an answer to HEAD has no body, whatever its content-length says
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._until_close = False  # the body ends when the connection does (RFC 9112 6.3: no length, not chunked)
        self._status: int | None = None
        self._body: list[bytes] = []
        self._held = 0  # bytes in _body: over READ_CHUNK, reading pauses until the proxy takes them
        self._complete = False
        self._failed: Broken | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None  # set while the engine's side is not taking the request
        self._relay: Relay | None = None
        self._wants_head = False
        self._stalled: Coroutine[Any, Any, None] | None = None  # a relayed piece waiting for the client (flow control)

    async def send(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Raises OSError (refused, missing) before anything reached the engine."""
        loop = asyncio.get_running_loop()
        if self.path is not None:
            await loop.create_unix_connection(lambda: self, str(self.path))
        else:
            assert self.address is not None
            host, port = self.address
            await loop.create_connection(lambda: self, host, port, ssl=self.tls)
        assert self._transport is not None
        self._head_only = method == b"HEAD"
        conn = h11.Connection(h11.CLIENT)
        head = [(b"host", self.host), *headers, (b"content-length", str(len(body)).encode())]
        data = conn.send(h11.Request(method=method, target=target, headers=head))
        data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        self._transport.write(data)
        if self._writable is not None:  # a large body the engine has not taken yet
            await self._writable
        if self._failed is not None and self._status is None:
            raise ConnectionError(str(self._failed))

    # asyncio's callbacks.
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self._parser.feed_data(self._buffer[:nbytes])
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, Broken) else exc
            self._fail(Broken(f"bad answer: {cause}"))
            assert self._transport is not None
            self._transport.close()
            return
        if self._relay is not None and self._body and self._stalled is None:
            self._pass_on()
        elif self._held > READ_CHUNK and self._transport is not None:
            self._transport.pause_reading()  # the proxy's client is slower than the engine: let the engine wait
        if self._body or self._complete or (self._wants_head and self._status is not None):
            self._wake()  # the task waiting for the answer has something to do (a relayed stream: only at its end)

    def eof_received(self) -> bool | None:
        return None  # close: an answer ends with its framing, never with a half-closed socket

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._complete and self._until_close and exc is None and self._failed is None:
            self._complete = True  # a close-delimited body ends here, whole
            self._wake()
        elif not self._complete:
            self._fail(Broken(str(exc) if exc else "the engine closed the connection"))
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # httptools' callbacks. An informational answer (1xx) comes and completes before the real one: skipped.
    def on_message_begin(self) -> None:
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD:
            raise Broken(f"an answer head over {MAX_HEAD} bytes")
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status >= 200:
            self._status = status
            self._complete = self._head_only or status in (204, 304)
            names = {name.lower() for name, _ in self._headers}
            self._until_close = b"content-length" not in names and b"transfer-encoding" not in names

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._held += len(body)

    def on_message_complete(self) -> None:
        if self._status is not None:
            self._complete = True

    def _fail(self, exc: Broken) -> None:
        if self._failed is None:
            self._failed = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _more(self) -> None:
        """Wait for the next bytes from the engine; raises `Broken` when its side closed or broke first."""
        if self._failed is not None:
            raise self._failed
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._held = 0
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()
        return data

    async def head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        self._wants_head = True
        while self._status is None:
            await self._more()
        self._wants_head = False
        return self._status, self._headers

    async def body(self) -> bytes | None:
        """The body bytes that arrived since the last call (waiting for some), or None after the last."""
        while not self._body and not self._complete:
            await self._more()
        return self._take() if self._body else None

    async def relay(self, forward: Relay) -> None:
        """Hand each body piece to `forward` (a coroutine that must not be cancelled half-way, as an ASGI send) as
        it arrives, until the last; raises `Broken` when the engine's side broke first (what came before it was
        handed on). A piece is handed on from the read callback: `forward` runs there, and only when it has to wait
        (the client is not reading: flow control) does the rest of it run here, with reading paused meanwhile."""
        try:
            while True:
                while self._body:  # more can come (and the end with it) while a piece is being handed on here
                    await forward(self._take())
                if self._complete:
                    return
                self._relay = forward
                try:
                    await self._more()
                finally:
                    self._relay = None
                while self._stalled is not None:
                    await self._finish_stalled()
        finally:
            if self._stalled is not None:
                self._stalled.close()
                self._stalled = None

    def _pass_on(self) -> None:
        """In the read callback: run the relay's `forward` on what arrived; if it has to wait, pause reading and
        wake `relay()` to finish it."""
        assert self._relay is not None
        step = self._relay(self._take())
        if not isinstance(step, Coroutine):  # an awaitable that cannot be stepped by hand: relay() awaits it
            self._stalled = _awaited(step)
        else:
            try:
                waiting = step.send(None)
            except StopIteration:
                return
            except BaseException as exc:  # it fails in relay(), not in asyncio's read callback
                self._stalled = _raising(exc)
            else:
                self._stalled = _resumed(step, waiting)
        if self._transport is not None:
            self._transport.pause_reading()
        self._wake()

    async def _finish_stalled(self) -> None:
        stalled = self._stalled
        assert stalled is not None
        try:
            await stalled
        finally:
            self._stalled = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()  # mid-answer, this is how the engine learns the client left


Relay = Callable[[bytes], Awaitable[None]]


async def _raising(exc: BaseException) -> None:
    raise exc


async def _awaited(step: Awaitable[None]) -> None:
    await step


def _settle(done: asyncio.Future[None]) -> Callable[[object], None]:
    def settle(_: object) -> None:
        if not done.done():
            done.set_result(None)

    return settle


async def _resumed(step: Coroutine[Any, Any, None], waiting: Any) -> None:
    """The rest of a coroutine that was run by hand (`step.send(None)`) until it yielded `waiting`: what an asyncio
    task would do with it (wait for the future it yielded, then resume it; pass a cancellation in), done here in the
    task awaiting this. The yielded future is already marked as awaited, so it is watched, not awaited again."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            if asyncio.isfuture(waiting):
                done = loop.create_future()
                waiting.add_done_callback(_settle(done))
                try:
                    await done
                except asyncio.CancelledError:
                    waiting.cancel()
                    raise
            else:  # a bare yield (asyncio.sleep(0))
                await asyncio.sleep(0)
        except BaseException as exc:  # cancelled: the coroutine gets to handle it, as under its own task
            try:
                waiting = step.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waiting = step.send(None)
        except StopIteration:
            return


class Broken(Exception):
    """The engine's connection closed or broke before its answer was complete."""
