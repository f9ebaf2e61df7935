"""A memory squeeze where nothing fits: the real daemon does not start its engine into the OOM killer, says why,
holds requests, and starts the engine by itself once /proc/meminfo (of the fake root) shows memory again."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.governor.daemon.daemon_proc import DaemonProc, device_tree
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

pytestmark = pytest.mark.slow

WAITING = re.compile(r"no tier fits in (\d+) MiB; waiting for memory")


def squeezed(root: Path) -> FakeTree:
    tree = device_tree(root)
    tree.meminfo(total_kb=16_000_000, available_kb=300_000)  # 293 MiB - the 256 MiB reserve: no demo tier fits
    return tree


def test_nothing_fits_means_no_engine_a_reason_and_a_start_once_memory_is_back(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path
) -> None:
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, config="request_hold_s = 0.5\n", tree=squeezed)
    try:

        def waiting() -> dict[str, Any]:
            d.check_alive()
            assert d.control.exists(), "no control socket yet"
            status = d.status()
            assert status["supervisor"]["waiting"], status["supervisor"]
            assert status["reason"], "no decision recorded yet"
            return status

        status = eventually(waiting, timeout_s=60)
        said = status["supervisor"]["waiting"]
        assert WAITING.fullmatch(said), said
        assert int(WAITING.fullmatch(said).group(1)) <= 40  # type: ignore[union-attr]
        assert said in status["reason"]  # `governor why` says it too
        ticks = status["ticks"]
        eventually(lambda: d.status()["ticks"] >= ticks + 4, timeout_s=30)  # several decisions later ...
        assert d.status()["supervisor"]["starts"] == 0  # ... still no start into the wall

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.engine_socket)), timeout=30) as client:
            held = client.post(
                "http://engine/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
        assert held.status_code == 503
        assert said in held.json()["error"]["message"]
        assert d.status()["supervisor"]["starts"] == 0

        d.tree.meminfo(total_kb=16_000_000, available_kb=12_000_000)
        back = d.wait_ready(timeout_s=120)
        assert back["supervisor"]["waiting"] is None
        assert back["supervisor"]["starts"] == 1
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.engine_socket)), timeout=60) as client:
            answer = client.post(
                "http://engine/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
        assert answer.status_code == 200
    finally:
        d.stop()
