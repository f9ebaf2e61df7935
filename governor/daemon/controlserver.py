"""The control socket's server: who may connect and how it stops (the commands are governor.daemon.control's).

One thread per connection, capped: a local user opening connections and sending nothing cannot exhaust the daemon's
threads or file descriptors; root and the daemon's own user (their uid from the kernel, SO_PEERCRED) get a reserve
beyond the cap, so an administrator's `governor status` still answers during a flood. Out of file descriptors, the
accept loop pauses instead of spinning. The socket is bound under a tight umask, then given its mode and group, in a
directory only we can write; `ControlServer` stops in phases: stop accepting, then end the open connections.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import socket
import socketserver
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from governor.daemon.control import CommandHandler, Commands, ControlApi, ControlError, peer_credentials
from governor.unixsock import check_private_dir, clear_stale_socket

MAX_CONNECTIONS = 32
RESERVED_CONNECTIONS = 16  # beyond the cap, for root and the daemon's own user


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, api: ControlApi) -> None:
        self.commands = Commands(api)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.refused = 0  # connections refused over the cap
        self._log = structlog.get_logger("governor.control")
        self._warned = 0.0
        self.stopping = False  # `ControlServer.stop_accepting` asked the accept loop to end
        super().__init__(path, partial(CommandHandler, shared=self.commands))

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """socketserver's accept loop, again after its select() failed: poll() refuses (EINVAL) while the process's
        file descriptor limit is under the descriptors it watches (RLIMIT_NOFILE lowered or exhausted), and the
        accept thread died of it, so the control socket never answered again (a fresh-clone run, session 6)."""
        while not self.stopping:
            try:
                super().serve_forever(poll_interval)
                return
            except OSError as exc:
                self._pause(f"the control socket's accept loop failed ({exc.strerror}); retrying")

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # Out of file descriptors: the listening socket stays readable, so pause instead of spinning.
                self._pause("cannot accept a control connection: out of file descriptors")
            raise

    def _pause(self, why: str) -> None:
        """Logged at most once a minute; a short sleep instead of a spin."""
        now = time.monotonic()
        if now - self._warned > 60:
            self._warned = now
            self._log.error(why)
        time.sleep(0.1)

    def process_request(self, request: Any, client_address: Any) -> None:
        cred = peer_credentials(request)
        trusted = cred is not None and cred[1] in (0, os.geteuid())
        with self._conns_lock:
            active = len(self._conns)
            admit = active < MAX_CONNECTIONS or (trusted and active < MAX_CONNECTIONS + RESERVED_CONNECTIONS)
            if admit:
                self._conns.add(request)
        if not admit:
            self.refused += 1
            with contextlib.suppress(OSError):
                request.settimeout(0.1)
                request.sendall(b'{"ok": false, "error": "too many connections; try again later"}\n')
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            with self._conns_lock:
                self._conns.discard(request)
            raise

    def close_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().close_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.commands.errors += 1
        self._log.exception("control connection failed")

    def server_bind(self) -> None:
        # Bound under a tight umask so the socket is never, even briefly, more open than asked.
        old = os.umask(0o177)
        try:
            super().server_bind()
        finally:
            os.umask(old)

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
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        check_private_dir(path.parent, ControlError)
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
        # No poll interval: an idle daemon's accept loop sleeps in select() until a client comes (a 0.25 s poll was
        # half of an idle daemon's CPU); `stop_accepting` wakes it with a connection of its own.
        # (None: typeshed says float, socketserver hands it to selector.select, where None blocks)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(None,), name="control", daemon=True)
        self._closed = False

    def start(self) -> None:
        self._thread.start()

    @property
    def errors(self) -> int:
        return self._server.commands.errors

    def stop_accepting(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.stopping = True
        if self._thread.is_alive():
            stopper = threading.Thread(target=self._server.shutdown, name="control-stop")  # asks, then waits
            stopper.start()
            while stopper.is_alive():  # the loop sees the request once select() returns: give it a connection
                with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as poke:
                    poke.connect(str(self.path))  # an empty request: the handler ends without a word
                stopper.join(0.05)
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        """Stop accepting, then end open connections (holds are released, recorders see EOF)."""
        self.stop_accepting()
        self._server.commands.closing.set()
        self._server.close_connections()
