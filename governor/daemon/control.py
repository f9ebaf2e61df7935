"""The control socket: JSON lines over a Unix stream socket, separate from the engine's chat socket.

One request line `{"cmd": ...}`, one answer line `{"ok": true, ...}` or `{"ok": false, "error": "..."}`. Two commands
keep the connection open: `hold` (the hold lives exactly as long as the connection, or until its TTL) and `record`
(one TraceRecord line per tick); so does `watch` (the status after each tick, at most one a second, with the
decisions made since: what `governor top` and the dashboard draw). `GET /metrics` in HTTP/1.x is answered with
Prometheus text, so `curl --unix-socket SOCK http://governor/metrics` works too.

This module is the protocol and the commands (one `CommandHandler` per connection); the server that accepts the
connections, caps them and stops in phases is governor.daemon.controlserver.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import socketserver
import struct
import threading
import time
from typing import Annotated, Any, Literal, Protocol

import structlog
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from govbase.errors import GovernorError
from policies.decision import Hold, HoldAsk, State
from sensors.snapshot import TraceRecord

POLL_S = 0.25  # how often a held connection checks its TTL and the server's shutdown
READ_TIMEOUT_S = 5.0  # a connection must send its request line within this; an idle one is closed
MAX_LINE = 65536
DAY_S = 86400.0
WATCH_EVERY_S = 1.0  # a watcher gets at most one status a second (hot ticks come four a second)
WATCH_DECISIONS = 20  # the decisions a watcher gets with its first answer
WATCH_SETTLE_S = 0.05  # a watcher's line waits this long after a tick, for the loop to be done with it
WATCH_IDLE_S = 30.0  # with no tick that long, a watcher's thread looks at the shutdown flag


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class _Plain(_Request):
    cmd: Literal["status", "reload", "metrics", "record", "watch"]


class _Why(_Request):
    cmd: Literal["why"]
    n: int = Field(default=10, ge=1, le=1000)


class _Hold(HoldAsk):
    model_config = _Request.model_config
    cmd: Literal["hold"]
    ttl_s: float | None = Field(default=None, gt=0, le=DAY_S)


_REQUEST: TypeAdapter[_Plain | _Why | _Hold] = TypeAdapter(Annotated[_Plain | _Why | _Hold, Field(discriminator="cmd")])
COMMANDS = "status, why, reload, metrics, hold, record or watch"


class ControlError(GovernorError):
    pass


class ControlApi(Protocol):
    """What the server needs from the daemon (the daemon implements it; tests use a small fake)."""

    def now(self) -> float: ...
    def status(self) -> dict[str, Any]: ...
    def why(self, n: int) -> list[dict[str, Any]]: ...
    def routes(self, n: int) -> list[dict[str, Any]]: ...
    def reload(self) -> dict[str, Any]: ...
    def metrics(self) -> str: ...
    def add_hold(self, hold: Hold) -> int: ...
    def release_hold(self, cookie: int) -> None: ...
    def subscribe(self) -> queue.Queue[TraceRecord | None]: ...
    def unsubscribe(self, q: queue.Queue[TraceRecord | None]) -> None: ...


def peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end, from the kernel (SO_PEERCRED): never what the client says."""
    try:
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (OSError, AttributeError):  # not Linux
        return None
    return pid, uid


def _peer(sock: socket.socket) -> str:
    cred = peer_credentials(sock)
    return "unknown peer" if cred is None else f"pid {cred[0]} uid {cred[1]}"


def _bad_request(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return f"not JSON: {err['msg']}"
    if err["type"] == "union_tag_invalid":
        return f"unknown command {err['input'].get('cmd')!r}; expected {COMMANDS}"
    if err["type"] == "union_tag_not_found":
        return f'a request needs a "cmd": {COMMANDS}'
    loc = [str(p) for p in err["loc"][1:]]  # the first is the command's tag
    if loc == ["state"] and err["type"] == "enum":
        return f"unknown state {err['input']!r}; expected one of {', '.join(s.value for s in State)}"
    msg = err["msg"].removeprefix("Value error, ")[:200]
    return f"{'.'.join(loc)}: {msg}" if loc else msg


class Commands:
    """What every connection's handler shares: the daemon's API, the stopping flag, the requests that failed inside
    the daemon, and the status after the latest tick (built once for every watcher)."""

    def __init__(self, api: ControlApi) -> None:
        self.api = api
        self.closing = threading.Event()
        self.errors = 0  # requests that failed inside the daemon (logged with their traceback)
        self._watched: tuple[TraceRecord | None, bytes] = (None, b"")  # the status after the latest tick, as JSON
        self._watched_lock = threading.Lock()

    def status_after(self, tick: TraceRecord) -> bytes:
        """The status after `tick` as JSON, built once however many watchers ask (each got the same record object):
        with `governor top` and a dashboard attached, building it per watcher doubled an idle daemon's CPU."""
        with self._watched_lock:
            if self._watched[0] is not tick:
                self._watched = (tick, json.dumps(self.api.status()).encode())
            return self._watched[1]


class CommandHandler(socketserver.StreamRequestHandler):
    """One connection: its request line, answered per command (governor.daemon.controlserver accepts it)."""

    timeout = READ_TIMEOUT_S  # applied to the socket in setup(): no connection waits forever for a line
    _pending: bytearray
    _deadline: float

    def __init__(self, request: Any, client_address: Any, server: socketserver.BaseServer, *, shared: Commands) -> None:
        self.shared = shared  # before the base class's __init__, which handles the request
        super().__init__(request, client_address, server)

    def _line(self, deadline: float) -> bytes:
        """One line (at most MAX_LINE bytes) that must be complete by `deadline`: the socket's timeout bounds each
        read only, and a client dripping a byte every 3 s held a connection for 45 s and more (issue 33)."""
        while True:
            end = self._pending.find(b"\n")
            if end >= 0 or len(self._pending) >= MAX_LINE:
                cut = MAX_LINE if end < 0 else end + 1
                line, self._pending = bytes(self._pending[:cut]), self._pending[cut:]
                return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.request.settimeout(left)
            data = self.request.recv(65536)
            if not data:
                line, self._pending = bytes(self._pending), bytearray()
                return line
            self._pending += data

    def handle(self) -> None:
        self._pending = bytearray()
        self._deadline = time.monotonic() + READ_TIMEOUT_S
        try:
            raw = self._line(self._deadline)
            self.request.settimeout(READ_TIMEOUT_S)  # for writing the answer: the deadline was the request's
            if len(raw) >= MAX_LINE and not raw.endswith(b"\n"):
                self._send({"ok": False, "error": f"bad request: longer than {MAX_LINE} bytes"})
                return
            line = raw.decode(errors="replace").strip()
            if line.startswith("GET "):
                self._http(line)
            elif line:
                self._json(line)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the client went away or sent nothing in time; nothing of it stays behind

    def _send(self, obj: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(obj).encode() + b"\n")
        self.wfile.flush()

    def _http(self, line: str) -> None:
        path = line.split()[1] if len(line.split()) > 1 else "/"
        while self._line(self._deadline).strip():
            pass  # headers, within the same READ_TIMEOUT_S as the request line
        self.request.settimeout(READ_TIMEOUT_S)
        if path == "/metrics":
            body, status = self.shared.api.metrics().encode(), "200 OK"
            ctype = "text/plain; version=0.0.4; charset=utf-8"
        else:
            body, status, ctype = b"only GET /metrics is served over HTTP\n", "404 Not Found", "text/plain"
        head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
        self.wfile.write(head.encode() + body)

    def _json(self, line: str) -> None:
        api = self.shared.api
        try:
            req = _REQUEST.validate_json(line)
        except ValidationError as exc:
            self._send({"ok": False, "error": f"bad request: {_bad_request(exc)}"})
            return
        try:
            if isinstance(req, _Why):
                self._send({"ok": True, "decisions": api.why(req.n), "routes": api.routes(req.n)})
            elif isinstance(req, _Hold):
                self._hold(req)
            elif req.cmd == "status":
                self._send({"ok": True, "status": api.status()})
            elif req.cmd == "reload":
                self._send(api.reload())
            elif req.cmd == "metrics":
                self._send({"ok": True, "text": api.metrics()})
            elif req.cmd == "watch":
                self._watch()
            else:
                self._record()
        except (OSError, TimeoutError):
            raise
        except GovernorError as exc:  # the daemon refused what was asked (e.g. a hold on a tier it does not have)
            self._send({"ok": False, "error": f"bad request: {exc}"})
        except Exception as exc:  # one request's bug must not take the server down: log it, answer, carry on
            structlog.get_logger("governor.control").exception("control request failed", cmd=req.cmd)
            self.shared.errors += 1
            with contextlib.suppress(OSError):
                self._send({"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"})

    def _hold(self, req: _Hold) -> None:
        api = self.shared.api
        if not req.asks():
            *some, last = HoldAsk.model_fields
            self._send({"ok": False, "error": f"bad request: a hold needs a {', '.join(some)} or {last}"})
            return
        hold = Hold(
            owner=_peer(self.request),
            expires_t=api.now() + req.ttl_s if req.ttl_s is not None else None,
            **req.asks(),
        )
        cookie = api.add_hold(hold)
        why = "disconnected"
        try:
            self._send({"ok": True, "hold": cookie, "owner": hold.owner, "expires_t": hold.expires_t})
            self.request.settimeout(POLL_S)
            while not self.shared.closing.is_set():
                if hold.expires_t is not None and api.now() >= hold.expires_t:
                    why = "ttl"
                    break
                try:
                    if not self.request.recv(1024):
                        break  # EOF: the client is gone
                except TimeoutError:
                    continue
            else:
                why = "shutdown"
            if why != "disconnected":
                with contextlib.suppress(OSError):
                    self._send({"event": "released", "why": why})
        finally:
            api.release_hold(cookie)
            structlog.get_logger("governor.control").info("hold released", hold=cookie, owner=hold.owner, why=why)

    def _record(self) -> None:
        api = self.shared.api
        q = api.subscribe()
        try:
            self._send({"ok": True})
            while not self.shared.closing.is_set():
                try:
                    record = q.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if record is None:
                    break
                self.wfile.write(record.model_dump_json().encode() + b"\n")
                self.wfile.flush()
        finally:
            api.unsubscribe(q)

    def _watch(self) -> None:
        """The status and the last decisions, then after each tick the status again with the decisions made since,
        at most every WATCH_EVERY_S. The thread sleeps on the tick feed between lines: a watcher costs the daemon
        one line a tick (a calm daemon ticks every 5 s), nothing while nothing happens."""
        api, closing = self.shared.api, self.shared.closing
        ticks = api.subscribe()
        try:
            decisions = api.why(WATCH_DECISIONS)
            self._send(
                {"ok": True, "wall": time.time(), "status": api.status(), "decisions": decisions}
                | {"routes": api.routes(WATCH_DECISIONS)}
            )
            seen = decisions[-1]["t"] if decisions else None
            sent = time.monotonic()
            while not closing.is_set():
                try:
                    tick = ticks.get(timeout=WATCH_IDLE_S)
                except queue.Empty:
                    continue
                # Wait out the rate limit, and at least until the loop has finished its tick: building the status
                # while the loop still runs its listeners would trade the GIL back and forth, waking both threads.
                pause = max(sent + WATCH_EVERY_S - time.monotonic(), WATCH_SETTLE_S)
                if tick is None or closing.wait(pause) or (tick := _drain(ticks, tick)) is None:
                    break
                new = _decisions_after(api, seen)
                seen = new[-1]["t"] if new else seen
                status = self.shared.status_after(tick)
                self.wfile.write(
                    b'{"wall": %r, "status": %s, "decisions": %s}\n' % (time.time(), status, json.dumps(new).encode())
                )
                self.wfile.flush()
                sent = time.monotonic()
        finally:
            api.unsubscribe(ticks)


def _drain(ticks: queue.Queue[TraceRecord | None], latest: TraceRecord) -> TraceRecord | None:
    """Empty the feed of the ticks a rate-limited watcher skips: the latest, or None when the daemon is stopping."""
    while True:
        try:
            tick = ticks.get_nowait()
        except queue.Empty:
            return latest
        if tick is None:
            return None
        latest = tick


def _decisions_after(api: ControlApi, seen_t: float | None) -> list[dict[str, Any]]:
    """The distinct decisions made after the one at loop time `seen_t`, oldest first: the last one alone is asked
    first (nothing new is the usual answer), then more until the seen one is among them."""
    n = 1 if seen_t is not None else WATCH_DECISIONS
    while True:
        decisions = api.why(n)
        if seen_t is None or len(decisions) < n or decisions[0]["t"] <= seen_t or n >= WATCH_DECISIONS:
            return [d for d in decisions if seen_t is None or d["t"] > seen_t]
        n = min(n * 4, WATCH_DECISIONS)
