"""Bounds on the public engine socket's connections: another local user must not exhaust the daemon's descriptors.

The socket is 0660 and its group's when `group` is set, so any member of the group can connect. uvicorn itself
keeps a connection that never sends a request forever, and has no cap: a member opening connections and sending
nothing would take one of the daemon's file descriptors each (two while a request is proxied), until the daemon can
open no sysfs file, no control connection and no engine pipe. So, as the control socket does (control.py):

- at most `max_connections` at once, from the descriptors the daemon may open (half of what its limit leaves after
  a reserve, at most 256); a peer uid other than root and the daemon's own gets a quarter of them at most;
- a connection over either cap gets `503` with `Retry-After` and is closed (logged at the 1st, 10th, 100th...
  refusal: a flood does not flood the journal);
- a connection must complete its request head within `READ_TIMEOUT_S` (as on the control socket), and uvicorn
  closes one idle between requests after its keep-alive timeout;
- a request head (request line and headers) is at most `MAX_HEAD` bytes, else `431` and the connection is closed:
  httptools holds a header's value whole before uvicorn sees it, and one 64 MB header was answered 200 (sixteen of
  them from another user took the daemon to 561 MB, issue 33).
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
from collections import Counter
from typing import Any

import structlog
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from governor.daemon.control import READ_TIMEOUT_S, peer_credentials
from governor.daemon.proxylink import error_body

MAX_CONNECTIONS = 256
MAX_HEAD = 64 * 2**10
FD_RESERVE = 256  # descriptors kept for sysfs reads, the control socket, the engine child and the log


def max_connections() -> int:
    """The cap for this process: each proxied request holds two descriptors (the client's, the engine's)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(8, min(MAX_CONNECTIONS, (soft - FD_RESERVE) // 2))


def _closing_answer(status: str, message: str, code: str, extra: str = "") -> bytes:
    body = error_body(message, code)
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n"
    )
    return head.encode() + body


def _busy(message: str) -> bytes:
    return _closing_answer("503 Service Unavailable", message, "too_many_connections", "retry-after: 1\r\n")


HEAD_TOO_LARGE = _closing_answer(
    "431 Request Header Fields Too Large", f"request head larger than {MAX_HEAD} bytes", "header_too_large"
)


class Guard:
    """The connections open now, by peer uid (shared by every connection of one server)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = max_connections() if limit is None else limit
        self.per_user = max(1, self.limit // 4)
        self.by_uid: Counter[int] = Counter()
        self.refused = 0
        self._log = structlog.get_logger("governor.proxy")

    def admit(self, uid: int) -> str | None:
        """None, and the connection counted, or why it is refused."""
        total = sum(self.by_uid.values())
        if total >= self.limit:
            return f"too many connections to the engine socket ({self.limit}); try again later"
        if uid not in (0, os.geteuid()) and self.by_uid[uid] >= self.per_user:
            return f"too many connections from uid {uid} ({self.per_user}); try again later"
        self.by_uid[uid] += 1
        return None

    def refuse(self, why: str) -> bytes:
        """Counts (and now and then logs) a refusal; the answer to write before closing the connection."""
        self.refused += 1
        if math.log10(self.refused).is_integer():
            self._log.warning("engine socket connection refused", reason=why, refused_total=self.refused)
        return _busy(why)

    def release(self, uid: int) -> None:
        self.by_uid[uid] -= 1
        if self.by_uid[uid] <= 0:
            del self.by_uid[uid]

    def protocol(self) -> type[asyncio.Protocol]:
        """uvicorn's HTTP protocol (httptools or h11), its connections counted and bounded by this guard."""
        guard = self

        class Guarded(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
            _uid: int | None = None
            _head_timer: asyncio.TimerHandle | None = None

            def connection_made(self, transport: Any) -> None:
                super().connection_made(transport)
                sock = transport.get_extra_info("socket")
                cred = None if sock is None else peer_credentials(sock)
                uid = -1 if cred is None else cred[1]
                refused = guard.admit(uid)
                if refused is not None:
                    transport.write(guard.refuse(refused))
                    transport.close()
                    return
                self._uid = uid
                self._head_timer = self.loop.call_later(READ_TIMEOUT_S, self._silent)

            _head_bytes = 0  # received since the last request head ended (or the connection began)
            _heads_ended = 0  # request heads that ended in the bytes being parsed

            def on_headers_complete(self) -> None:
                self._heads_ended += 1
                self._head_bytes = 0
                super().on_headers_complete()

            def data_received(self, data: bytes) -> None:
                self._heads_ended = 0
                super().data_received(data)
                # No head ended in these bytes and none is being answered: all of them belong to one unfinished head.
                answering = self.cycle is not None and not self.cycle.response_complete
                if not self._heads_ended and not answering and not self.transport.is_closing():
                    self._head_bytes += len(data)
                    if self._head_bytes > MAX_HEAD:
                        self.transport.write(HEAD_TOO_LARGE)
                        self.transport.close()

            def _silent(self) -> None:
                self._head_timer = None
                if self.cycle is None:  # no request head yet: a connection that says nothing is closed
                    self.transport.close()

            def connection_lost(self, exc: Exception | None) -> None:
                if self._head_timer is not None:
                    self._head_timer.cancel()
                    self._head_timer = None
                if self._uid is not None:
                    guard.release(self._uid)
                    self._uid = None
                super().connection_lost(exc)

        return Guarded
