"""The rate cap for an engine that cannot hold its own tokens (llama.cpp's llama-server): paced on the public socket.

The built-in engine holds each token until 1/cap after the previous one, so its threads idle in between: the cap
cuts heat, not only the client's rate. llama-server has no such setting, and pacing only what the client sees would
leave it computing at full speed into its buffers. So the public socket does both:

- a streamed answer's events leave no faster than the cap (the first at once, each next one 1/cap after the one
  before, or later when the engine is slower), read from the engine only as fast as they leave (its socket fills);
- while an event that came early waits for its turn, the engine is held (SIGSTOP) and let go (SIGCONT) when the
  event leaves: it computed that token ahead of the pace, so its compute follows the cap too (a duty cycle, as
  cpulimit does it; the built-in engine's threads idle the same way). A hold never outlasts the wait, whatever way
  the answer ends (a cancel lets go first).

A non-streamed answer is not paced (its body leaves whole): the cap applies to streams, as clients that care about a
token rate read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable

MAX_HOLD_S = 1.0  # the engine is held at most this long at a time, then let run for GAP_S (its status polls get
GAP_S = 0.02  # through); a cap of 1 tok/s or more never needs a second hold for one token
EVENT_END = b"\n\n"  # llama-server writes one SSE event per token


class Pace:
    """The cap in force (None: none), set by the engine's driver; `relay` paces one streamed answer."""

    def __init__(self, pid: Callable[[], int | None] = lambda: None) -> None:
        """`pid()`: the engine process to hold while it runs ahead (None: not held, only paced)."""
        self.cap: float | None = None
        self._pid = pid
        self.holds = 0  # times the engine was held, for status

    @property
    def active(self) -> bool:
        return self.cap is not None

    async def relay(
        self, body: Callable[[], Awaitable[bytes | None]], send: Callable[[bytes], Awaitable[None]]
    ) -> None:
        """Pass on `body()`'s pieces until it returns None, each event no sooner than the pace allows: the first at
        once, each next one 1/cap after the one before (later when the engine is slower: no burst to catch up)."""
        loop = asyncio.get_running_loop()
        due: float | None = None  # when the next event may leave
        while (data := await body()) is not None:
            for event in _events(data):
                if due is not None and due > loop.time():
                    await self._wait(due)
                await send(event)
                cap = self.cap
                due = None if cap is None else loop.time() + 1.0 / cap

    async def _wait(self, due: float) -> None:
        """Until `due`, holding the engine: it computed this event early, so it is ahead of the pace."""
        loop = asyncio.get_running_loop()
        while (left := due - loop.time()) > 0:
            pid = self._hold()
            try:
                await asyncio.sleep(min(left, MAX_HOLD_S))
            finally:
                if pid is not None:
                    _release(pid)
            if due - loop.time() > GAP_S:
                await asyncio.sleep(GAP_S)

    def _hold(self) -> int | None:
        pid = self._pid()
        if pid is None:
            return None
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError:
            return None
        self.holds += 1
        return pid


def _release(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGCONT)


def _events(data: bytes) -> list[bytes]:
    """`data` split after each SSE event's blank line (the last piece may be a partial event: it goes on as is)."""
    pieces: list[bytes] = []
    start = 0
    while (end := data.find(EVENT_END, start)) != -1:
        pieces.append(data[start : end + 2])
        start = end + 2
    if start < len(data):
        pieces.append(data[start:])
    return [p for p in pieces if p]
