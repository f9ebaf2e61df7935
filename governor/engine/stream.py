"""An answer on its way out: the worker → event-loop hand-off and the SSE response (the OpenAI objects: replies.py).

Per token the loop does little: the worker appends events to a deque and wakes the loop at most once per batch
(`call_soon_threadsafe` only when no wake-up is pending); one SSE write carries every token that arrived since the
last one, so a client (or a loop) slower than the model gets several tokens per chunk, and the first token goes out
as soon as it exists. The SSE body is written straight to the ASGI server, without a task group or a per-token task.

With a stream interval (see `stream_interval_s`), text waits until that long after the previous write, so a fast
model's tokens leave a few at a time: every chunk costs the client (the openai SDK: ~1 ms of CPU) and the loop CPU,
and when the decode threads hold every core, that CPU is taken from them (they wait for each other at every step).
The first text and every other event (end, error, model change) still go out at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from governor.engine.config import default_threads
from governor.engine.events import Ended, Event, Failed, ModelChanged, Text, Trimmed
from governor.engine.replies import Reply, dumps

KEEPALIVE_S = 15.0  # a stream with nothing to say this long (paused, reloading) gets an SSE comment
KEEPALIVE = ": keep-alive\n\n"  # ignored by SSE clients (the openai SDK too), but it resets their read timeout
AUTO_INTERVAL_S = 0.2  # 5 writes a second at most: the client's and the loop's per-chunk CPU ~0.7 % of a core


def stream_interval_s(setting_ms: float | None, threads: int) -> float:
    """The stream interval for an answer that starts now: `setting_ms` when given (0 = every token at once), else
    (auto) AUTO_INTERVAL_S when the decode threads take every CPU this process may run on — the client's work then
    runs on a core a decode thread needs — and 0 when a core is left for it."""
    if setting_ms is not None:
        return setting_ms / 1000
    return AUTO_INTERVAL_S if threads >= default_threads() else 0.0


class Events:
    """One generation's events, handed from the worker thread to the event loop.

    Not `eager` (a non-streamed answer): text does not wake the loop at all, only the other events do. Eager, text
    is handed out no sooner than `interval_s` after the last batch that carried text (the first text at once); every
    other event at once, with the text before it. `hang_up()` (on the loop, when the client goes away) makes
    `batch()` return None.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, eager: bool, interval_s: float = 0.0) -> None:
        self._loop = loop
        self._eager = eager
        self._interval_s = interval_s
        self._items: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._scheduled = False  # a wake-up is on its way to the loop
        self._urgent = False  # an event other than text is waiting
        self._timer: asyncio.TimerHandle | None = None  # the stream interval runs: text waits for its end
        self.gone = False
        self.ended = False  # the worker sent the last event (Ended or Failed)

    def __call__(self, event: Event) -> None:  # on the worker thread
        self._items.append(event)
        if not isinstance(event, Text):
            self.ended = self.ended or isinstance(event, Ended | Failed)
            self._urgent = True
        elif not self._eager or self._timer is not None:
            return  # the timer looks when the interval is over (it clears `_timer` before it looks at the deque)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._scheduled = False
        self._resume()

    def _interval_over(self) -> None:
        self._timer = None  # first: a token the worker appends from now on wakes the loop itself
        self._resume()

    def _resume(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def hang_up(self) -> None:
        self.gone = True
        self._resume()

    async def batch(self, quiet_s: float | None = None) -> list[Event] | None:
        """Every event that arrived since the last call (waiting for the first one, and for text while the
        interval runs); None once the client is gone; an empty list when nothing came for `quiet_s`."""
        loop = self._loop
        give_up = None if quiet_s is None else loop.time() + quiet_s
        while not self.gone:
            if self._items:
                if self._urgent or self._timer is None:  # no interval running (text is held only while one is)
                    break
            elif give_up is not None and loop.time() >= give_up:
                return []
            self._waiter = loop.create_future()
            # While the interval runs its timer wakes the loop first: no keep-alive timer for each chunk.
            quiet = None if give_up is None or self._timer is not None else loop.call_at(give_up, self._resume)
            try:
                await self._waiter
            finally:
                self._waiter = None
                if quiet is not None:
                    quiet.cancel()
        if self.gone:
            return None
        self._urgent = False
        out = list(self._items)
        for _ in out:
            self._items.popleft()
        if self._eager and self._interval_s > 0 and any(isinstance(ev, Text) for ev in out):
            # The next text may leave when the interval is over: a timer wakes the loop then, and the worker's text
            # does not wake it meanwhile (one wake-up a chunk, not two).
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_later(self._interval_s, self._interval_over)
        return out


async def watch_disconnect(receive: Receive, events: Events) -> None:
    """Tells `events` when the client goes away (uvicorn answers `receive()` with http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    events.hang_up()


async def sse(
    events: Events, backlog: list[Event], reply: Reply, include_usage: bool, *, keepalive_s: float = KEEPALIVE_S
) -> AsyncIterator[str]:
    """The SSE text of a streamed answer, one piece per batch of events, and a comment after `keepalive_s` without
    one (an answer paused for memory or waiting on a reload: a client's read timeout must not end it); ends early
    when the client goes away."""
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
        batch = await events.batch(keepalive_s)
        if batch == []:
            yield KEEPALIVE


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
