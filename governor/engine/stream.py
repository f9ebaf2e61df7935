"""An answer on its way out: the worker → event-loop hand-off and the SSE response (the OpenAI objects: replies.py).

Per token the loop does little: the worker appends events to a deque and wakes the loop at most once per batch
(`call_soon_threadsafe` only when no wake-up is pending); one SSE write carries every token that arrived since the
last one, so a client (or a loop) slower than the model gets several tokens per chunk, and the first token goes out
as soon as it exists. The SSE body is written straight to the ASGI server, without a task group or a per-token task.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from governor.engine.events import Ended, Event, Failed, ModelChanged, Text, Trimmed
from governor.engine.replies import Reply, dumps


class Events:
    """One generation's events, handed from the worker thread to the event loop.

    Not `eager` (a non-streamed answer): text does not wake the loop at all, only the other events do.
    `hang_up()` (on the loop, when the client goes away) makes `batch()` return None.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, eager: bool) -> None:
        self._loop = loop
        self._eager = eager
        self._items: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._scheduled = False
        self.gone = False
        self.ended = False  # the worker sent the last event (Ended or Failed)

    def __call__(self, event: Event) -> None:  # on the worker thread
        self._items.append(event)
        if isinstance(event, Ended | Failed):
            self.ended = True
        if not self._eager and isinstance(event, Text):
            return
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._scheduled = False
        self._resume()

    def _resume(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def hang_up(self) -> None:
        self.gone = True
        self._resume()

    async def batch(self) -> list[Event] | None:
        """Every event that arrived since the last call (waiting for the first one); None once the client is gone."""
        while not self._items and not self.gone:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.gone:
            return None
        out = list(self._items)
        for _ in out:
            self._items.popleft()
        return out


async def watch_disconnect(receive: Receive, events: Events) -> None:
    """Tells `events` when the client goes away (uvicorn answers `receive()` with http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    events.hang_up()


async def sse(events: Events, backlog: list[Event], reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """The SSE text of a streamed answer, one piece per batch of events; ends early when the client goes away."""
    yield reply.opening()
    batch: list[Event] | None = backlog
    while batch is not None:
        out: list[str] = []
        text: list[str] = []
        finished = False
        for ev in batch:
            if isinstance(ev, Text):
                text.append(ev.text)
                continue
            if text:
                out.append(reply.text("".join(text)))
                text = []
            match ev:
                case Trimmed(total):
                    reply.governor["trimmed_messages"] = total
                case ModelChanged(model):
                    reply.set_model(model)
                case Failed(_status, message, code):
                    err = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
                    out.append(f"data: {dumps(err)}\n\n")
                    finished = True
                case Ended(finish, usage, governor):
                    reply.governor.update(governor)
                    out.append(reply.end(finish, usage, include_usage))
                    finished = True
        if text:
            out.append(reply.text("".join(text)))
        if finished:
            out.append("data: [DONE]\n\n")
        piece = "".join(out)
        if piece:
            yield piece
        if finished:
            return
        batch = await events.batch()


class EventStream(Response):
    """A `text/event-stream` response whose pieces go straight to the ASGI server's `send`.

    `on_close` runs however the response ends (finished, client gone, error).
    """

    media_type = "text/event-stream"

    def __init__(
        self, body: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str] | None = None
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for piece in self._body:
                await send({"type": "http.response.body", "body": piece.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._on_close()
