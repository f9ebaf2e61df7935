"""Fixtures for the daemon's tests: short socket directories (a Unix socket path must fit in 108 bytes)."""

from __future__ import annotations

import shutil
import socket
import tempfile
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
    """A real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[dict[str, str]] = []

    def drain(self) -> list[dict[str, str]]:
        while True:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                return self.messages
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def fields(self) -> list[str]:
        return [key for message in self.drain() for key in message]

    def close(self) -> None:
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
