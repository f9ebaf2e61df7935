"""The control socket: JSON lines over a Unix stream socket, separate from the engine's chat socket.

One request line `{"cmd": ...}`, one answer line `{"ok": true, ...}` or `{"ok": false, "error": "..."}`. Two commands
keep the connection open: `hold` (the hold lives exactly as long as the connection, or until its TTL) and `record`
(one TraceRecord line per tick). `GET /metrics` in HTTP/1.x is answered with Prometheus text, so
`curl --unix-socket SOCK http://governor/metrics` works too.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import queue
import socket
import socketserver
import struct
import threading
from pathlib import Path
from typing import Any, Protocol

import structlog
from pydantic import ValidationError

from governor.errors import GovernorError
from governor.unixsock import clear_stale_socket
from policies.decision import Hold, State
from sensors.snapshot import TraceRecord

POLL_S = 0.25  # how often a held connection checks its TTL and the server's shutdown


class ControlError(GovernorError):
    pass


class ControlApi(Protocol):
    """What the server needs from the daemon (the daemon implements it; tests use a small fake)."""

    def now(self) -> float: ...
    def status(self) -> dict[str, Any]: ...
    def why(self, n: int) -> list[dict[str, Any]]: ...
    def reload(self) -> dict[str, Any]: ...
    def metrics(self) -> str: ...
    def add_hold(self, hold: Hold) -> int: ...
    def release_hold(self, cookie: int) -> None: ...
    def subscribe(self) -> queue.Queue[TraceRecord | None]: ...
    def unsubscribe(self, q: queue.Queue[TraceRecord | None]) -> None: ...


def _peer(sock: socket.socket) -> str:
    try:
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (OSError, AttributeError):  # not Linux
        return "client"
    return f"pid {pid} uid {uid}"


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.server.track(self.request, add=True)
        try:
            line = self.rfile.readline(65536).decode(errors="replace").strip()
            if line.startswith("GET "):
                self._http(line)
            elif line:
                self._json(line)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; nothing of it stays behind
        finally:
            self.server.track(self.request, add=False)

    def _send(self, obj: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(obj).encode() + b"\n")
        self.wfile.flush()

    def _http(self, line: str) -> None:
        path = line.split()[1] if len(line.split()) > 1 else "/"
        while self.rfile.readline(65536).strip():
            pass  # headers
        if path == "/metrics":
            body, status = self.server.api.metrics().encode(), "200 OK"
            ctype = "text/plain; version=0.0.4; charset=utf-8"
        else:
            body, status, ctype = b"only GET /metrics is served over HTTP\n", "404 Not Found", "text/plain"
        head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
        self.wfile.write(head.encode() + body)

    def _json(self, line: str) -> None:
        api = self.server.api
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("a request is a JSON object")
            cmd = req.get("cmd")
            if cmd == "status":
                self._send({"ok": True, "status": api.status()})
            elif cmd == "why":
                self._send({"ok": True, "decisions": api.why(int(req.get("n", 10)))})
            elif cmd == "reload":
                self._send(api.reload())
            elif cmd == "metrics":
                self._send({"ok": True, "text": api.metrics()})
            elif cmd == "hold":
                self._hold(req)
            elif cmd == "record":
                self._record()
            else:
                raise ValueError(f"unknown command {cmd!r}; expected status, why, reload, metrics, hold or record")
        except (ValueError, TypeError, ValidationError) as exc:
            reason = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            self._send({"ok": False, "error": f"bad request: {reason}"})

    def _hold(self, req: dict[str, Any]) -> None:
        api = self.server.api
        ttl = req.get("ttl_s")
        state = req.get("state")
        if state is not None and state not in {s.value for s in State}:
            raise ValueError(f"unknown state {state!r}; expected one of {', '.join(s.value for s in State)}")
        hold = Hold(
            owner=str(req.get("owner") or _peer(self.request)),
            state=State(state) if state is not None else None,
            max_threads=req.get("max_threads"),
            max_tokens_per_s=req.get("max_tokens_per_s"),
            expires_t=api.now() + float(ttl) if ttl is not None else None,
        )
        if hold.state is None and hold.max_threads is None and hold.max_tokens_per_s is None:
            raise ValueError("a hold needs a state, max_threads or max_tokens_per_s")
        cookie = api.add_hold(hold)
        why = "disconnected"
        try:
            self._send({"ok": True, "hold": cookie, "owner": hold.owner, "expires_t": hold.expires_t})
            self.request.settimeout(POLL_S)
            while not self.server.closing.is_set():
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
        api = self.server.api
        q = api.subscribe()
        try:
            self._send({"ok": True})
            while not self.server.closing.is_set():
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


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, api: ControlApi) -> None:
        self.api = api
        self.closing = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(path, _Handler)

    def server_bind(self) -> None:
        # Bound under a tight umask so the socket is never, even briefly, more open than asked.
        old = os.umask(0o177)
        try:
            super().server_bind()
        finally:
            os.umask(old)

    def track(self, conn: socket.socket, *, add: bool) -> None:
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class ControlServer:
    def __init__(self, path: Path, api: ControlApi, *, mode: int = 0o600, group: str | None = None) -> None:
        self.path = path
        if len(os.fsencode(path)) >= 108:
            raise ControlError(f"{path}: a Unix socket path must be shorter than 108 bytes")
        path.parent.mkdir(parents=True, exist_ok=True)
        clear_stale_socket(
            path, lambda reason: ControlError(f"{path}: {reason}"), in_use="another governor is already listening there"
        )
        try:
            gid = grp.getgrnam(group).gr_gid if group else -1
        except KeyError:
            raise ControlError(f"control socket group {group!r} does not exist") from None
        self._server = _Server(str(path), api)
        if group:
            mode |= 0o060
            os.chown(path, -1, gid)
        os.chmod(path, mode)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(POLL_S,), name="control", daemon=True)
        self._closed = False

    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        """Stop accepting, then end open connections (holds are released, recorders see EOF)."""
        self.stop_accepting()
        self._server.closing.set()
        self._server.close_connections()
