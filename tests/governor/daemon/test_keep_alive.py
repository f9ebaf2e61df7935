"""The policy's [engine] keep_alive_s reaches the engine the daemon starts: it unloads when idle, `governor status`
says so, and the next request is served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.governor.daemon.daemon_proc import TEST_POLICY, DaemonProc
from tests.helpers import eventually

pytestmark = pytest.mark.slow


@pytest.fixture
def idle_daemon(tmp_path: Path, sock_dir: Path, demo_ladder: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, policy=TEST_POLICY + "\n[engine]\nkeep_alive_s = 1.0\n")
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()


def test_engine_unloads_when_idle_and_the_status_says_so(idle_daemon: DaemonProc) -> None:
    eventually(lambda: idle_daemon.status()["engine"]["loaded"] is False, timeout_s=60)
    extra = idle_daemon.engine.status().model_extra or {}
    assert extra["keep_alive_s"] == 1  # the policy's value, passed on the engine's command line
    answer = idle_daemon.engine.chat([{"role": "user", "content": "hi"}], model="small", max_tokens=2)
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    after = idle_daemon.engine.status()
    assert after.loaded is True
    assert (after.model_extra or {})["unloads_total"] >= 1
