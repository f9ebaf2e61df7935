"""The control socket's client, used by `governor status/why/hold/reload/record/metrics/top/dashboard`."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from governor.daemon.control import ControlError


class ControlClient:
    def __init__(self, path: Path, *, timeout_s: float = 15.0) -> None:
        self.path = path
        self.timeout_s = timeout_s

    @contextmanager
    def _connect(self, request: dict[str, Any]) -> Iterator[tuple[socket.socket, Any]]:
        """A frozen daemon, one that closes mid-answer or answers garbage is a one-line ControlError, never a
        traceback (issue 33: `governor reload` against a stopped daemon)."""
        sock = self._dial()
        with self._one_line_errors(), sock, sock.makefile("rb") as lines:
            sock.sendall(json.dumps(request).encode() + b"\n")
            yield sock, lines

    @contextmanager
    def _one_line_errors(self) -> Iterator[None]:
        try:
            yield
        except TimeoutError:
            raise ControlError(f"the governor at {self.path} did not answer within {self.timeout_s:g} s") from None
        except OSError as exc:
            raise ControlError(f"the governor at {self.path} broke the connection: {exc.strerror or exc}") from None
        except ValueError as exc:  # json's errors, a line that is not UTF-8
            raise ControlError(f"the governor at {self.path} answered something that is not JSON: {exc}") from None

    def _dial(self) -> socket.socket:
        """Connect; a full listen backlog (EAGAIN: the daemon is alive but behind, e.g. another user floods the
        socket) is retried until the timeout rather than reported as an unreachable governor."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.005
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.path))
            except BlockingIOError:
                sock.close()
                if time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    pause = min(pause * 2, 0.2)
                    continue
                raise ControlError(f"the governor at {self.path} did not accept within {self.timeout_s:g} s") from None
            except OSError as exc:
                sock.close()
                raise ControlError(
                    f"cannot reach the governor at {self.path}: {exc.strerror or exc} (is `governor run` running?)"
                ) from None
            return sock

    @staticmethod
    def _answer(lines: Any) -> dict[str, Any]:
        raw = lines.readline()
        if not raw:
            raise ControlError("the governor closed the connection without answering")
        answer: dict[str, Any] = json.loads(raw)
        if not answer.get("ok", True):
            raise ControlError(str(answer.get("error", "request failed")))
        return answer

    def request(self, cmd: str, **fields: Any) -> dict[str, Any]:
        with self._connect({"cmd": cmd, **fields}) as (_sock, lines):
            return self._answer(lines)

    @contextmanager
    def hold(self, **fields: Any) -> Iterator[tuple[dict[str, Any], Iterator[dict[str, Any]]]]:
        """Holds while the `with` block runs; the iterator yields the daemon's events (e.g. the TTL ended).

        The daemon's faults are one-line ControlErrors; the `with` block's own exceptions pass through as they are
        (wrapped, a test's ValueError read as "answered something that is not JSON")."""
        sock = self._dial()
        with sock, sock.makefile("rb") as lines:
            with self._one_line_errors():
                sock.sendall(json.dumps({"cmd": "hold", **fields}).encode() + b"\n")
                answer = self._answer(lines)
                sock.settimeout(None)

            def events() -> Iterator[dict[str, Any]]:
                with self._one_line_errors():
                    for raw in lines:
                        yield json.loads(raw)

            yield answer, events()

    def take_hold(self, **fields: Any) -> tuple[dict[str, Any], socket.socket]:
        """A hold kept by another process on its users' behalf (the dashboard): it lasts until the returned socket is
        closed, its TTL ends or the daemon stops."""
        stream = self._open({"cmd": "hold", **fields})
        return stream.first, stream.sock

    def watch(self) -> Stream:
        """The `watch` stream: its first answer now, then a line after each tick (Stream.lines, Stream.fileno)."""
        watch = self._open({"cmd": "watch"})
        watch.sock.settimeout(None)
        return watch

    def _open(self, request: dict[str, Any]) -> Stream:
        """A connection that stays open after its answer (`first`; what came after it stays in the stream), with
        the same one-line errors as a request's."""
        stream = Stream(self._dial())
        try:
            with self._one_line_errors():
                stream.sock.sendall(json.dumps(request).encode() + b"\n")
                stream.first = self._answer(stream)
        except BaseException:
            stream.close()
            raise
        return stream

    def record(self, seconds: float | None = None) -> Iterator[str]:
        """Trace lines (TraceRecord JSON), one per tick, until the daemon stops, `seconds` pass, or the caller stops."""
        deadline = None if seconds is None else time.monotonic() + seconds
        with self._connect({"cmd": "record"}) as (sock, lines):
            self._answer(lines)
            while True:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    sock.settimeout(left)
                else:
                    sock.settimeout(None)
                try:
                    raw = lines.readline()
                except TimeoutError:
                    return
                if not raw:
                    return
                yield raw.decode().rstrip("\n")


class Stream:
    """An open stream of JSON lines (`watch`), read as they come without blocking once `fileno()` is readable
    (select), so one thread can wait on the daemon and on a keyboard or a timer at once."""

    MAX_PENDING = 1 << 20  # a line longer than this is not the daemon's: give up rather than buffer it all

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.first: dict[str, Any] = {}

    def fileno(self) -> int:
        return self.sock.fileno()

    def readline(self) -> bytes:
        """One whole line, blocking (the first answer); b"" at EOF."""
        while b"\n" not in self._buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return b""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line + b"\n"

    def lines(self) -> list[dict[str, Any]]:
        """Every whole line that has arrived, without waiting: call it when `fileno()` is readable, and once right
        after the first answer (a line that came with it is already here). ControlError once the daemon closed it."""
        try:
            chunk = self.sock.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            chunk = None
        except (ConnectionResetError, TimeoutError) as exc:
            raise ControlError(f"the governor's watch stream broke: {exc}") from None
        if chunk == b"" and b"\n" not in self._buf:
            raise ControlError("the governor closed the watch stream (stopped or restarted?)")
        *whole, self._buf = (self._buf + (chunk or b"")).split(b"\n")
        if len(self._buf) > self.MAX_PENDING:
            raise ControlError(f"the governor sent a line longer than {self.MAX_PENDING} bytes")
        try:
            return [json.loads(line) for line in whole if line.strip()]
        except ValueError as exc:  # json's errors, a line that is not UTF-8
            raise ControlError(f"the governor's watch stream sent something that is not JSON: {exc}") from None

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
