"""Sending a chat request to an OpenAI-compatible upstream (httpx), and marking answers with where they ran.

Streamed answers are passed through chunk by chunk as they arrive (`aiter_raw`: no re-framing); only the events
before the first token are held, so that an upstream failing before it can still be replaced by the device
(`UpstreamFailed`, nothing sent yet). After the first token a failure ends the stream with an OpenAI-shaped error
event and `[DONE]`: nothing silently lost. Non-streamed answers are read whole first.

Every chat answer says where it ran: the header `x-governor-route: local | upstream:NAME`, and a `governor` object
(`{"route", "why"}`, merged into the engine's own) in the JSON body or the first streamed event.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from governor.daemon.routing import ChatInfo, UpstreamLink

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

ROUTE_HEADER = b"x-governor-route"
LOCAL_ONLY_HEADER = b"x-governor-local-only"
PASSED_HEADERS = frozenset({b"content-type", b"x-request-id", b"openai-processing-ms", b"retry-after"})


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
    except ValueError:
        return content
    return _merge(data, fields) if isinstance(data, dict) else content


def _events(buffer: bytes) -> list[bytes]:
    """The complete SSE events at the start of `buffer` (each without its blank-line terminator)."""
    return buffer.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]


def _payload(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


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


def make_client(link: UpstreamLink) -> httpx.AsyncClient:
    cfg = link.config
    transport = httpx.AsyncHTTPTransport(uds=str(cfg.socket)) if cfg.socket is not None else None
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(cfg.timeout_s), trust_env=False)


def _request(link: UpstreamLink, client: httpx.AsyncClient, path: str, info: ChatInfo, local_tier: str | None) -> Any:
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
    url = link.config.base_url + path.removeprefix("/v1")
    return client.build_request("POST", url, content=json.dumps(data).encode(), headers=headers)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def forward(
    link: UpstreamLink,
    client: httpx.AsyncClient,
    path: str,
    info: ChatInfo,
    *,
    local_tier: str | None,
    fields: dict[str, Any],
    send: Send,
    on_first_token: Callable[[], None],
    on_broken: Callable[[str], None],
) -> None:
    """The whole exchange with the upstream, relayed to the client. Raises `UpstreamFailed` when nothing was sent."""
    try:
        response = await client.send(_request(link, client, path, info, local_tier), stream=True)
    except httpx.HTTPError as exc:
        raise UpstreamFailed(link.scrub(_describe(exc))) from exc
    try:
        await _relay(link, response, info, fields, send, on_first_token, on_broken)
    finally:
        await response.aclose()


async def _relay(  # noqa: PLR0917 (one call site, in order)
    link: UpstreamLink,
    response: httpx.Response,
    info: ChatInfo,
    fields: dict[str, Any],
    send: Send,
    on_first_token: Callable[[], None],
    on_broken: Callable[[str], None],
) -> None:
    route = [(ROUTE_HEADER, str(fields["route"]).encode())]
    headers = [(k, v) for k, v in response.headers.raw if k.lower() in PASSED_HEADERS] + route
    streamed = response.headers.get("content-type", "").startswith("text/event-stream")
    chunks = response.aiter_raw()
    try:
        if not response.is_success:
            text = (await response.aread())[:300].decode(errors="replace")
            raise UpstreamFailed(link.scrub(f"HTTP {response.status_code}: {text}"))
        if not streamed:
            content = mark_json(await response.aread(), fields)
            on_first_token()
            headers.append((b"content-length", str(len(content)).encode()))
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            await send({"type": "http.response.body", "body": content, "more_body": False})
            return
        held = b""
        async for chunk in chunks:
            held += chunk
            if first_token_seen(held):
                break
        if not held:
            raise UpstreamFailed("the upstream closed the stream before the first token")
    except httpx.HTTPError as exc:
        raise UpstreamFailed(link.scrub(_describe(exc))) from exc
    on_first_token()
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": mark_first_event(held, fields), "more_body": True})
    try:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except httpx.HTTPError as exc:
        why = link.scrub(_describe(exc))
        on_broken(why)
        message = f"upstream {link.name} failed after the first token: {why}"
        await send({"type": "http.response.body", "body": error_event(message, "upstream_failed"), "more_body": False})
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})
