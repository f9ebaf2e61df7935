"""Fixtures for the daemon's tests: short socket directories (a Unix socket path must fit in 108 bytes)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.governor.daemon.daemon_proc import DaemonProc, NotifySocket


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gv", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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
