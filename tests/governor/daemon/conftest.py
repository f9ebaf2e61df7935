"""Fixtures for the daemon's tests: short socket directories (a Unix socket path must fit in 108 bytes)."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.governor.daemon.daemon_proc import DaemonProc


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gv", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class NotifySocket:
    """A real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET.

    Read continuously on a thread, as systemd does: a datagram socket nobody reads fills up after a few messages,
    and the sender then blocks.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="notify-socket", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set() and self._receive() is not None:
            pass

    def _receive(self) -> bool | None:
        """One datagram if one comes within the socket's timeout (True), else False; None once the socket closed."""
        with self._lock:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                return False
            except OSError:
                return None
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))
            return True

    def drain(self) -> list[dict[str, str]]:
        """Every message so far, including any still queued on the socket."""
        while self._receive():
            pass
        with self._lock:
            return list(self.messages)

    def fields(self) -> list[str]:
        return [key for message in self.drain() for key in message]

    def close(self) -> None:
        self._closed.set()
        self._reader.join(5.0)
        self.sock.close()


@pytest.fixture
def notify_socket(sock_dir: Path) -> Iterator[NotifySocket]:
    ns = NotifySocket(sock_dir / "notify")
    yield ns
    ns.close()


@pytest.fixture
def daemon(tmp_path: Path, sock_dir: Path, demo_ladder: Path) -> Iterator[DaemonProc]:
    """A real `governor run` process on a fake device tree and the demo ladder, ready."""
    d = DaemonProc(tmp_path, sock_dir, demo_ladder)
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()
