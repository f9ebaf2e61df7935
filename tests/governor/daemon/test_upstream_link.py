"""The exchange with an upstream (governor/daemon/upstream.py) over TCP against a scripted OpenAI-compatible server:
what the client receives, and which failures fall back (UpstreamFailed: nothing sent) or end the stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from governor.daemon.config import Upstream
from governor.daemon.routing import UpstreamLink, chat_info
from governor.daemon.upstream import UpstreamFailed, forward

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
OPENING = b'data: {"model":"big","choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
TOKEN = b'data: {"model":"big","choices":[{"delta":{"content":"Paris"},"finish_reason":null}]}\n\n'
FIELDS = {"route": "upstream:lan", "why": "hot"}
Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@asynccontextmanager
async def scripted(script: Script, seen: list[bytes]) -> AsyncIterator[int]:
    """An HTTP server on 127.0.0.1 that records each request's head and body and answers with `script`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        )
        seen.append(head + await reader.readexactly(length))
        try:
            await script(writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


def run(script: Script, **upstream: Any) -> tuple[list[dict[str, Any]], list[str], bytes]:
    """Forward one streamed chat request; (the ASGI messages sent, the broken reports, the request seen)."""
    sent: list[dict[str, Any]] = []
    broken: list[str] = []
    seen: list[bytes] = []

    async def main() -> None:
        async with scripted(script, seen) as port:
            config = Upstream(name="lan", base_url=f"http://127.0.0.1:{port}/api/v1", model="big", **upstream)
            link = UpstreamLink(config, "sk-KEY")
            body = b'{"model": "large", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            await forward(
                link,
                "/v1/chat/completions",
                chat_info(body),
                local_tier="large",
                fields=FIELDS,
                send=send,  # type: ignore[arg-type]
                on_first_token=lambda: None,
                on_broken=broken.append,
            )

    asyncio.run(main())
    return sent, broken, seen[0] if seen else b""


def body_of(sent: list[dict[str, Any]]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_stream_passes_through_marked_with_the_route_and_the_key_goes_to_the_upstream_only() -> None:
    async def script(w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + chunk(OPENING))
        await w.drain()
        for part in (TOKEN, TOKEN, b"data: [DONE]\n\n"):
            w.write(chunk(part))
            await w.drain()
        w.write(b"0\r\n\r\n")

    sent, broken, request = run(script)
    assert request.startswith(b"POST /api/v1/chat/completions HTTP/1.1\r\n")
    assert b"host: 127.0.0.1:" in request.lower()
    assert b"authorization: Bearer sk-KEY" in request
    assert json.loads(request.split(b"\r\n\r\n", 1)[1])["model"] == "big"  # mapped
    start = sent[0]
    assert start["status"] == 200
    assert (b"x-governor-route", b"upstream:lan") in start["headers"]
    events = body_of(sent).split(b"\n\n")
    assert json.loads(events[0][6:])["governor"] == FIELDS
    assert events[1:] == [TOKEN[:-2], TOKEN[:-2], b"data: [DONE]", b""]
    assert not broken


def test_an_error_answer_or_silence_fails_before_anything_is_sent() -> None:
    async def error(w: asyncio.StreamWriter) -> None:
        w.write(b'HTTP/1.1 401 Unauthorized\r\ncontent-length: 28\r\n\r\n{"error": "bad key sk-KEY"}\n')

    with pytest.raises(UpstreamFailed, match=r"HTTP 401: .*bad key \*\*\*"):
        run(error)

    async def silent(w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(1.5)  # the upstream stalls past timeout_s

    with pytest.raises(UpstreamFailed, match="no answer within timeout_s"):
        run(silent, timeout_s=0.2)

    async def opening_then_cut(w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + chunk(OPENING))  # the role chunk, then the connection ends: no token yet

    with pytest.raises(UpstreamFailed):
        run(opening_then_cut)


def test_after_the_first_token_a_cut_or_a_stall_ends_the_stream_with_an_error_event() -> None:
    async def cut(w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + chunk(OPENING) + chunk(TOKEN))

    sent, broken, _ = run(cut)
    events = body_of(sent).split(b"\n\n")
    assert json.loads(events[-3][6:])["error"]["code"] == "upstream_failed"
    assert events[-2:] == [b"data: [DONE]", b""]
    assert len(broken) == 1

    async def stall(w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + chunk(OPENING) + chunk(TOKEN))
        await w.drain()
        await asyncio.sleep(1.5)  # the upstream stalls past timeout_s

    sent, broken, _ = run(stall, timeout_s=0.3)
    error = json.loads(body_of(sent).split(b"\n\n")[-3][6:])["error"]
    assert error["message"] == "upstream lan failed after the first token: no answer within timeout_s"
