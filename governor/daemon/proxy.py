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
thread and event loop (governor.daemon.publicsocket), and one connection per request to the private socket, its
answer parsed by httptools (proxylink.EngineLink; httpx's Unix socket streams re-register the socket with epoll at
every read, which tripled the per-token cost; docs/benchmarks.md compares aiohttp's client too). A
request that never reached the engine (connect refused while it restarts) is sent again to the next engine, within the
same hold.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol

import structlog

from govbase.errors import GovernorError
from governor.daemon import upstream as routed
from governor.daemon.pacing import Pace
from governor.daemon.proxylink import (
    LOCAL,
    Broken,
    EngineLink,
    Message,
    Receive,
    Send,
    disconnected,
    error_body,
    forwarded,
    send_error,
)
from governor.daemon.restarts import Availability
from governor.daemon.routing import ChatInfo, Route, Router, chat_info

Scope = MutableMapping[str, Any]
UpstreamRequest = tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]  # method, target, headers, body

POLL_S = 0.05  # how often a held request looks at the engine's availability
DEATH_WAIT_S = 3.0  # after the upstream connection broke, how long to wait for the supervisor's word on why
PRIVATE_PATHS = frozenset({"/engine/pause", "/engine/config"})  # engine paths the public socket does not pass on
# llama-server's slot actions and settings: saving, restoring and erasing the conversation the governor keeps across
# restarts, writing files into its directory (POST /slots/0?action=save), changing its properties
PRIVATE_PREFIXES = ("/slots", "/props")
MAX_BODY = 16 * 2**20  # the proxy's own bound (the engine's limits per path are lower and answer for themselves)
CHAT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def _more(data: bytes) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": True}


class ProxyError(GovernorError):
    pass


class _TooLarge(Exception):
    pass


class _QueueFull(Exception):
    """The engine answered 429 queue_full to a request an upstream may take (nothing was sent to the client)."""


class EngineGate(Protocol):
    """What the proxy needs from the supervisor (governor.daemon.supervisor.EngineSupervisor)."""

    def availability(self) -> Availability: ...
    def request_started(self, *, chat: bool) -> int: ...
    def request_ended(self, start: int, *, answered: bool) -> None: ...
    def exit_of(self, start: int) -> str | None: ...


class ProxyApp:
    """The ASGI app: every request on the public socket goes to the engine's private socket, or gets a clear 5xx."""

    def __init__(
        self,
        upstream: Path | tuple[str, int],
        gate: EngineGate,
        *,
        hold_s: float,
        router: Router | None = None,
        pace: Pace | None = None,
        rewrite: Callable[[str, bytes], bytes] | None = None,
    ) -> None:
        """`upstream`: the engine's Unix socket, or (host, port) of an external engine; `pace`: the rate cap of an
        engine that cannot hold its own tokens (llama-server, an external one), paced here; `rewrite(path, body)`:
        a request body with the decided settings an external engine takes per request (governor.daemon.external)."""
        self.upstream, self.gate, self.hold_s, self.pace, self.rewrite = upstream, gate, hold_s, pace, rewrite
        self.router = router if router is not None and router.enabled else None
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
            await send_error(send, 413, f"request body larger than {MAX_BODY} bytes", "body_too_large")
            return
        if body is None:
            return  # the client left before it finished sending
        path = scope["path"].rstrip("/")
        if path in PRIVATE_PATHS or (scope["method"] != "GET" and path.startswith(PRIVATE_PREFIXES)):
            # The engine's settings and its memory pause are the daemon's to set: a client on the public socket (any
            # member of its group) could otherwise keep the engine unloaded, or reloading, with a request a second.
            await send_error(
                send, 403, f"{scope['path']} is the governor's own control; not on this socket", "forbidden"
            )
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        chat = scope["method"] == "POST" and scope["path"] in CHAT_PATHS
        headers = forwarded(scope["headers"])
        info = chat_info(body, headers) if chat else None
        headers = [(k, v) for k, v in headers if k not in (routed.LOCAL_ONLY_HEADER, routed.CLASS_HEADER)]
        body = body if info is None else info.body
        if self.rewrite is not None:
            body = self.rewrite(scope["path"], body)
        request = (scope["method"].encode(), target, headers, body)
        sent = asyncio.Event()  # the whole answer went to the client
        if info is not None and self.router is not None:
            job = self._routed(request, info, path=scope["path"], send=send, sent=sent)
        else:
            job = self._exchange(request, chat, send, sent)
        work = asyncio.ensure_future(job)
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and not sent.is_set():
                # The client left: dropping the upstream connection makes the engine cancel the answer.
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        finally:
            gone.cancel()

    async def _routed(
        self, request: UpstreamRequest, info: ChatInfo, *, path: str, send: Send, sent: asyncio.Event
    ) -> None:
        """A chat request with routing on: to the first healthy upstream when the device cannot meet the target
        (or the engine cannot answer, or answers that its queue is full), else here; an upstream failing before its
        first token falls back here."""
        assert self.router is not None
        router = self.router
        route = router.choose(info, self.gate.availability())
        router.routed(route, stream=info.stream)
        began = asyncio.get_running_loop().time()
        tried: set[str] = set()
        while True:  # each upstream once at most, then the device; local at most twice (a 429 queue_full first)
            if route.upstream is not None:
                tried.add(route.upstream.name)
                why = await self._upstream(route, path, info, send, began)
                if why is None:
                    sent.set()
                    return
                following = router.first_healthy(skip=tried)
                if following is not None:
                    route = Route(following, route.kind, f"{why}; trying upstream {following.name}: {route.reason}")
                else:
                    route = Route(None, "fallback", f"{why}; answered on the device")
                router.routed(route, stream=info.stream)
                if following is not None:
                    continue
            spill = route.kind == "meets" and router.first_healthy(skip=tried) is not None
            marks = {"route": route.label, "why": route.reason}
            try:
                await self._exchange(request, True, send, sent, marks=marks, info=info, spill=spill)
            except _QueueFull:
                upstream = router.first_healthy(skip=tried)
                route = Route(upstream, "queue_full", "the engine answered that its queue is full")
                router.routed(route, stream=info.stream)
                continue
            router.answered(route, ttft_s=None, total_s=asyncio.get_running_loop().time() - began)
            return

    async def _upstream(self, route: Route, path: str, info: ChatInfo, send: Send, began: float) -> str | None:
        """Relay the request from `route`'s upstream; None once done, else how it failed before its first token
        (nothing was sent)."""
        assert self.router is not None
        assert route.upstream is not None
        router, link = self.router, route.upstream
        loop = asyncio.get_running_loop()
        first: list[float] = []
        try:
            await routed.forward(
                link,
                path,
                info,
                local_tier=router.local_tier(),
                fields={"route": route.label, "why": route.reason},
                send=send,
                on_first_token=lambda: first.append(loop.time()),
                on_broken=lambda why: router.failed(link, phase="after_first_token", error=why),
            )
        except routed.UpstreamFailed as exc:
            router.failed(link, phase="before_first_token", error=str(exc))
            return f"upstream {link.name} failed before the first token ({link.scrub(str(exc))[:200]})"
        router.answered(route, ttft_s=first[0] - began if first else None, total_s=loop.time() - began)
        return None

    async def _exchange(
        self,
        request: tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes],
        chat: bool,
        send: Send,
        sent: asyncio.Event,
        *,
        marks: dict[str, Any] | None = None,
        info: ChatInfo | None = None,
        spill: bool = False,
    ) -> None:
        """`spill`: raise `_QueueFull` (nothing sent) when the engine answers 429 queue_full: an upstream takes it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_s
        while True:
            avail = self.gate.availability()
            if avail.given_up or (not avail.ready and loop.time() >= deadline):
                code = "engine_unavailable" if avail.given_up else "engine_starting"
                await send_error(send, 503, avail.reason, code, avail.retry_after_s, chat=chat)
                return
            if not avail.ready:
                await asyncio.sleep(POLL_S)
                continue
            start = self.gate.request_started(chat=chat)
            up = self.upstream
            upstream = EngineLink(up) if isinstance(up, Path) else EngineLink(None, address=up, host=up[0].encode())
            try:
                await upstream.send(*request)
            except OSError:
                # It never reached the engine (which just died or is not listening yet): hold it for the next one.
                upstream.close()
                if chat:
                    self.gate.request_ended(start, answered=False)
                await asyncio.sleep(POLL_S)
                continue
            except asyncio.CancelledError:
                upstream.close()
                if chat:
                    self.gate.request_ended(start, answered=True)  # the client left; the engine did nothing wrong
                raise
            break
        whole = False
        try:
            whole = await self._forward(upstream, send, start, chat=chat, marks=marks, info=info, spill=spill)
            sent.set()
        except (asyncio.CancelledError, _QueueFull):
            whole = True  # an answer (or the client left): the engine did nothing wrong
            raise
        finally:
            upstream.close()
            if chat:  # ended either way (an external server's busy count); answered only when relayed whole
                self.gate.request_ended(start, answered=whole)

    async def _forward(
        self,
        upstream: EngineLink,
        send: Send,
        start: int,
        *,
        chat: bool = False,
        marks: dict[str, Any] | None = None,
        info: ChatInfo | None = None,
        spill: bool = False,
    ) -> bool:
        """Relay the engine's answer; True when it was relayed whole, False when the engine died under it. A chat
        answer gets the route header, and with routing on the `governor` field (`marks`)."""
        loop = asyncio.get_running_loop()
        began, idle = loop.time(), self.router is not None and not self.router.engine_busy()
        try:
            status, head_headers = await upstream.head()
        except Broken as exc:
            msg = await self._died(start, exc)
            await send_error(send, 502, msg, "engine_died", self._retry_after(), chat=chat)
            return False
        headers = forwarded(head_headers) + (LOCAL if chat else [])
        streamed = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        if not streamed:  # read whole before sending: a truncated JSON must never look like a complete one
            parts: list[bytes] = []
            size = 0
            try:
                while (data := await upstream.body()) is not None:
                    parts.append(data)
                    size += len(data)
                    if size > routed.MAX_ANSWER:
                        raise Broken(f"its answer passed {routed.MAX_ANSWER} bytes")
            except Broken as exc:
                msg = await self._died(start, exc)
                await send_error(send, 502, msg, "engine_died", self._retry_after(), chat=chat)
                return False
            content = b"".join(parts)
            if spill and status == 429 and b"queue_full" in content:
                raise _QueueFull
            if marks is not None and status == 200:
                content = routed.mark_json(content, marks)
            headers.append((b"content-length", str(len(content)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content, "more_body": False})
            return True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if marks is not None:
            ended = await self._first_token(upstream, send, start, marks)
            if ended is not None:
                return ended
            if self.router is not None and info is not None:
                self.router.local_ttft(info.prompt_tokens, loop.time() - began, idle=idle)
        try:
            if self.pace is not None and self.pace.active:
                await self.pace.relay(upstream.body, lambda data: send(_more(data)))
            else:
                await upstream.relay(lambda data: send(_more(data)))
        except Broken as exc:
            error = b"data: " + error_body(await self._died(start, exc), "engine_died") + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": error, "more_body": False})
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    async def _first_token(self, upstream: EngineLink, send: Send, start: int, marks: dict[str, Any]) -> bool | None:
        """Hold a stream's opening events until the first token and send them with the `governor` field merged
        into the first one. None: the stream goes on; else it ended (True: whole, False: the engine died)."""
        held = b""
        try:
            while not routed.first_token_seen(held):
                data = await upstream.body()
                if data is None:
                    body = routed.mark_first_event(held, marks)
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    return True
                held += data
        except Broken as exc:
            error = b"data: " + error_body(await self._died(start, exc), "engine_died") + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": held + error, "more_body": False})
            return False
        await send({"type": "http.response.body", "body": routed.mark_first_event(held, marks), "more_body": True})
        return None

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
