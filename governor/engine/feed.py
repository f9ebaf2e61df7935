"""`GET /engine/events`: the engine's status pushed as JSON lines, one when it changes, none while nothing does.

The daemon used to poll `GET /engine/status` every tick: a fresh HTTP round trip with JSON on both sides, about
20 ms of CPU each, four times a second while mitigating. Now it keeps one connection open and the engine writes a
line when something the governor reads changes: busy or idle (a request arriving wakes the daemon at once), the
settings after a change, and while generating a refresh every `busy_refresh_s` (the decode rate the daemon
shows). An idle engine writes nothing and wakes for nothing; `?heartbeat_s=N` asks for a line at least every N s
(a liveness signal for a client that wants one): a blank line when the status is the one last written, so an idle
engine's heartbeat costs neither side a JSON document (the daemon's is every 5 s, all day: issue 16). The stream
ends when the client goes away or the engine stops.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.types import Receive


class StatusFeed:
    """Change notifications from any thread, turned into status lines on the event loop."""

    def __init__(self, status: Callable[[], dict[str, Any]], busy: Callable[[], bool], busy_refresh_s: float = 1.0):
        self._status = status
        self._busy = busy
        self.busy_refresh_s = busy_refresh_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._pending = False
        self.closed = False

    def changed(self) -> None:
        """Something a reader cares about changed (any thread; cheap when nobody listens)."""
        loop = self._loop
        if loop is None or self._pending:
            return
        self._pending = True  # several changes before the loop runs make one line
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop has closed: the engine is exiting
            self._pending = False

    def close(self) -> None:
        """End every stream (on the loop's thread): uvicorn's shutdown waits for open responses to finish."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._pending = False
        if self._event is not None:
            self._event.set()  # waiters hold this event; later ones get a fresh one
            self._event = asyncio.Event()

    async def lines(self, heartbeat_s: float | None, receive: Receive) -> AsyncIterator[str]:
        """The current status now, then a line per change until the client goes away or the feed closes."""
        gone = asyncio.ensure_future(_disconnected(receive))
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._event is None:
            self._event = asyncio.Event()
        last: dict[str, Any] | None = None
        timed_out = False  # the last wait ended on its timeout: a line is due even if nothing changed
        try:
            while not self.closed and not gone.done():
                event = self._event
                status = self._status()
                if status != last:
                    yield json.dumps(status, separators=(",", ":")) + "\n"
                    last = status
                elif timed_out:
                    yield "\n"  # nothing new: a change notice that changed nothing writes nothing at all
                timeout = self.busy_refresh_s if self._busy() else heartbeat_s
                waiter: asyncio.Future[Any] = asyncio.ensure_future(event.wait())
                waiters: set[asyncio.Future[Any]] = {waiter, gone}
                done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                timed_out = not done
                waiter.cancel()
        finally:
            gone.cancel()


async def _disconnected(receive: Receive) -> None:
    """Returns when the client goes away (uvicorn answers `receive()` with http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
