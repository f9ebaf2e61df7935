"""Sending a chat request to an OpenAI-compatible upstream, and marking answers with where they ran.

The connection is the proxy's own link (`proxylink.EngineLink`: an asyncio stream, h11 to frame the request,
httptools to parse the answer) over the upstream's Unix socket, or TCP (TLS for https): httpx's async streams cost
about 0.8 ms of CPU per streamed chunk here (bench/bench_proxy.py --mode routed), several times the link's.
Streamed answers are passed through chunk by chunk as they arrive (no re-framing of the events); only the events
before the first token are held, so that an upstream failing before it can still be replaced by the device
(`UpstreamFailed`, nothing sent yet). After the first token a failure ends the stream with an OpenAI-shaped error
event and `[DONE]`: nothing silently lost. Non-streamed answers are read whole first.

Every chat answer says where it ran: the header `x-governor-route: local | upstream:NAME`, and a `governor` object
(`{"route", "why"}`, merged into the engine's own) in the JSON body or the first streamed event.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from governor.daemon.proxylink import CLASS_HEADER, LOCAL_ONLY_HEADER, ROUTE_HEADER, Broken, EngineLink
from governor.daemon.routing import ChatInfo, UpstreamLink

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

Header = tuple[bytes, bytes]
__all__ = ["CLASS_HEADER", "LOCAL_ONLY_HEADER", "ROUTE_HEADER", "UpstreamFailed", "forward"]
PASSED_HEADERS = frozenset({b"content-type", b"x-request-id", b"openai-processing-ms", b"retry-after"})
MAX_ANSWER = 16 * 2**20  # a whole (not streamed) answer, held to be checked and marked: past it, refused
MAX_OPENING = 2**20  # a stream's events before its first token (held, so that the device can still take over)


class UpstreamFailed(Exception):
    """The upstream failed before the first token: nothing reached the client."""


def _merge(data: dict[str, Any], fields: dict[str, Any]) -> bytes:
    ours = data.get("governor")
    data["governor"] = (ours if isinstance(ours, dict) else {}) | fields
    return json.dumps(data, separators=(",", ":")).encode()


def mark_json(content: bytes, fields: dict[str, Any]) -> bytes:
    """A whole JSON answer with `fields` merged into its `governor` object (anything else: unchanged)."""
    try:
        data = json.loads(content)
    except (ValueError, RecursionError):
        return content
    return _merge(data, fields) if isinstance(data, dict) else content


def _events(buffer: bytes) -> list[bytes]:
    """The complete SSE events at the start of `buffer` (each without its blank-line terminator)."""
    return buffer.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]


def _payload(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def malformed_event(buffer: bytes) -> bytes | None:
    """The first complete event's payload that is neither JSON nor `[DONE]` (None: all well formed)."""
    for event in _events(buffer):
        payload = _payload(event)
        if payload is None or payload.strip() == b"[DONE]":
            continue
        try:
            json.loads(payload)
        except (ValueError, RecursionError):
            return payload
    return None


def first_token_seen(buffer: bytes) -> bool:
    """Whether the events received so far carry a token (content, a tool call, a finish) or the end: the opening
    event (the role, an empty content) is not one."""
    for event in _events(buffer):
        payload = _payload(event)
        if payload is None:
            continue
        try:
            data = json.loads(payload)
        except ValueError:
            return True  # [DONE] or something that is not a chunk: the answer has begun (or ended)
        if not isinstance(data, dict) or "error" in data:
            return True
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or choice.get("finish_reason") or choice.get("text"):
                return True
    return False


def mark_first_event(buffer: bytes, fields: dict[str, Any]) -> bytes:
    """`buffer` (the held start of a stream) with `fields` merged into the first event's chunk."""
    end = buffer.find(b"\n\n")
    if not buffer.startswith(b"data: {") or end < 0:
        return buffer
    try:
        data = json.loads(buffer[6:end])
    except ValueError:
        return buffer
    if not isinstance(data, dict):
        return buffer
    return b"data: " + _merge(data, fields) + buffer[end:]


def error_event(message: str, code: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"


def open_link(link: UpstreamLink) -> tuple[EngineLink, bytes]:
    """A connection to the upstream (its Unix socket, else host:port, TLS for https) and the path prefix."""
    url = urlsplit(link.config.base_url)
    host = (url.netloc or "upstream").encode()
    if link.config.socket is not None:
        return EngineLink(link.config.socket, host=host), url.path.encode()
    port = url.port or (443 if url.scheme == "https" else 80)
    conn = EngineLink(None, address=(url.hostname or "localhost", port), host=host)
    if url.scheme == "https":
        conn.tls = ssl.create_default_context()
    return conn, url.path.encode()


def _request(link: UpstreamLink, path: str, info: ChatInfo, local_tier: str | None) -> tuple[list[Header], bytes]:
    data = dict(info.data or {})
    model = link.model_for(info.model, local_tier)
    if model is not None:
        data["model"] = model
    accept = b"text/event-stream" if info.stream else b"application/json"
    headers = [
        (b"content-type", b"application/json"),
        (b"accept", accept),
        (b"accept-encoding", b"identity"),  # passed through as it comes: no decompressing per chunk
        *link.auth_headers(),
    ]
    return headers, json.dumps(data).encode()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer within timeout_s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def forward(
    link: UpstreamLink,
    path: str,
    info: ChatInfo,
    *,
    local_tier: str | None,
    fields: dict[str, Any],
    send: Send,
    on_first_token: Callable[[], None],
    on_broken: Callable[[str], None],
) -> None:
    """The whole exchange with the upstream, relayed to the client. Raises `UpstreamFailed` when nothing was sent.
    `timeout_s` bounds the connection and the answer's head, then each wait for more of the answer."""
    conn, prefix = open_link(link)
    headers, body = _request(link, path, info, local_tier)
    route = [(ROUTE_HEADER, str(fields["route"]).encode())]
    try:
        try:
            async with asyncio.timeout(link.config.timeout_s) as deadline:
                await conn.send(b"POST", prefix + path.removeprefix("/v1").encode(), headers, body)
                status, head = await conn.head()
                head = [(k.lower(), v) for k, v in head if k.lower() in PASSED_HEADERS] + route
                held, streamed = await _until_first_token(link, conn, status, head, deadline)
        except (OSError, Broken, TimeoutError) as exc:
            raise UpstreamFailed(link.scrub(_describe(exc))) from exc
        on_first_token()
        scrub = link.scrubber.data  # the key never reaches the client, whatever the upstream echoes
        head = [(k, scrub(v)) for k, v in head]
        if not streamed:  # the whole answer, marked
            content = mark_json(scrub(held), fields)
            head.append((b"content-length", str(len(content)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": head})
            await send({"type": "http.response.body", "body": content, "more_body": False})
            return
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": mark_first_event(scrub(held), fields), "more_body": True})
        await _stream_rest(link, conn, send, on_broken)
    finally:
        conn.close()


async def _until_first_token(
    link: UpstreamLink, conn: EngineLink, status: int, head: list[Header], deadline: asyncio.Timeout
) -> tuple[bytes, bool]:
    """(a streamed answer's events up to its first token, True), or (an answer that is not streamed, whole, False).
    Raises UpstreamFailed for an error answer or a stream that ends before a token."""
    loop = asyncio.get_running_loop()
    if not 200 <= status < 300:
        text = (await _whole(conn, MAX_OPENING))[:300].decode(errors="replace")
        raise UpstreamFailed(link.scrub(f"HTTP {status}: {text}"))
    if not any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in head):
        whole = await _whole(conn, MAX_ANSWER)
        try:
            data = json.loads(whole)
        except (ValueError, RecursionError):
            raise UpstreamFailed(f"HTTP {status} with a body that is not JSON ({len(whole)} bytes)") from None
        if not isinstance(data, dict):
            raise UpstreamFailed(f"HTTP {status} with JSON that is not an object")
        return whole, False
    held = b""
    while not first_token_seen(held):
        data = await conn.body()
        if data is None:
            break
        held += data
        if len(held) > MAX_OPENING:
            raise UpstreamFailed(f"over {MAX_OPENING} bytes of events before the first token")
        deadline.reschedule(loop.time() + link.config.timeout_s)
    if not held:
        raise UpstreamFailed("the upstream closed the stream before the first token")
    if (bad := malformed_event(held)) is not None:
        raise UpstreamFailed(f"a streamed event that is not JSON: {bad[:60]!r}")
    return held, True


async def _stream_rest(link: UpstreamLink, conn: EngineLink, send: Send, on_broken: Callable[[str], None]) -> None:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(link.config.timeout_s) as deadline:
            while (data := await conn.body()) is not None:
                deadline.reschedule(loop.time() + link.config.timeout_s)
                await send({"type": "http.response.body", "body": link.scrubber.data(data), "more_body": True})
    except (Broken, TimeoutError) as exc:
        why = link.scrub(_describe(exc))
        on_broken(why)
        message = f"upstream {link.name} failed after the first token: {why}"
        await send({"type": "http.response.body", "body": error_event(message, "upstream_failed"), "more_body": False})
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _whole(conn: EngineLink, limit: int) -> bytes:
    """The rest of the answer, refused past `limit` bytes (a 300 MB answer took the daemon to 1.4 GB)."""
    parts, size = [], 0
    while (data := await conn.body()) is not None:
        size += len(data)
        if size > limit:
            raise UpstreamFailed(f"an answer over {limit} bytes")
        parts.append(data)
    return b"".join(parts)
