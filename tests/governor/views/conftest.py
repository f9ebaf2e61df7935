"""The views' tests run against a real daemon on a fake device tree (tests/governor/daemon's harness)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.governor.daemon.daemon_proc import DaemonProc

ZONE_TEMP = "sys/class/thermal/thermal_zone0/temp"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, demo_ladder: Path) -> Iterator[DaemonProc]:
    """One daemon per test module: 45 °C against an 80 °C trip, battery 15 % charging, the engine idle."""
    sock_dir = Path(tempfile.mkdtemp(prefix="gv", dir="/tmp"))  # a Unix socket path must fit in 108 bytes
    d = DaemonProc(tmp_path_factory.mktemp("views"), sock_dir, demo_ladder)
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
