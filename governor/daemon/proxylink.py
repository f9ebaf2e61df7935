"""The proxy's parts (governor.daemon.proxy): the HTTP/1.1 link to the engine child's private socket, the uvicorn
server that holds the public one without waking up ten times a second, and the error answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import h11
import httptools
import uvicorn

READ_CHUNK = 64 * 2**10
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
    """The OpenAI error shape, as the engine itself answers it (governor.engine.app.error)."""
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


class EngineLink:
    """One HTTP/1.1 exchange with the engine on its Unix socket: an asyncio stream (the socket stays registered with
    the loop, so a token costs one read), h11 to frame the request and httptools (C, llhttp) to parse the answer: h11's
    pure-Python chunk parser was 40 % of the proxy's CPU per token (issue 16). Every body piece that arrived by one
    read is handed on as one: a client that fell behind gets the tokens that piled up in one chunk. A fresh
    connection per request: connecting to a local socket costs microseconds, and a dead engine's connections never
    need weeding out of a pool."""

    def __init__(self, path: Path | None, *, address: tuple[str, int] | None = None, host: bytes = b"engine") -> None:
        """`path`: a Unix socket; else `address` (host, port) over TCP (TLS with `tls`); `host`: the Host header."""
        self.path, self.address, self.host = path, address, host
        self.tls: ssl.SSLContext | None = None
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
        if self.path is not None:
            self._reader, self._writer = await asyncio.open_unix_connection(str(self.path), limit=READ_CHUNK)
        else:
            assert self.address is not None
            host, port = self.address
            self._reader, self._writer = await asyncio.open_connection(host, port, ssl=self.tls, limit=READ_CHUNK)
        self._head_only = method == b"HEAD"
        conn = h11.Connection(h11.CLIENT)
        head = [(b"host", self.host), *headers, (b"content-length", str(len(body)).encode())]
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
        """Feed the parser the next bytes; raises `Broken` when the engine's side closed or broke first."""
        assert self._reader is not None
        try:
            data = await self._reader.read(READ_CHUNK)
        except OSError as exc:
            raise Broken(str(exc)) from exc
        if not data:
            raise Broken("the engine closed the connection")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise Broken(f"bad answer from the engine: {exc}") from exc

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


class Broken(Exception):
    """The engine's connection closed or broke before its answer was complete."""


class QuietServer(uvicorn.Server):
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
