"""Runs last (file order): after every fault above, the daemon that took them still runs, serves, and governs
with the last good policy."""

from __future__ import annotations

from typing import Any

import pytest

from tests.governor.daemon.daemon_proc import DaemonProc
from tests.helpers import eventually

pytestmark = pytest.mark.slow
FAULT_KIND = "after the whole run"


def test_the_victim_still_serves_with_the_last_good_policy(victim: DaemonProc) -> None:
    # The sensor faults left it hot a moment ago: it comes back once the zone reads normally again.
    def calm() -> dict[str, Any]:
        status = victim.status()
        assert status["state"] in ("idle", "sustained"), status["reason"]
        assert status["config"]["threads"] == 4, status["reason"]  # back up one thread per recover step
        return status

    status = eventually(calm, timeout_s=30)
    assert status["errors"]["loop"] == 0
    assert status["errors"]["control"] == 0
    # The good policy's idle profile (the tree has 4 CPUs), not one of the 46 bad files on disk.
    assert status["config"]["max_tokens_per_s"] == 60.0
    hello = [{"role": "user", "content": "still there?"}]
    answer = victim.engine.chat(hello, model=victim.engine.status().model, max_tokens=4)
    assert answer["usage"]["completion_tokens"] > 0
    assert victim.client.request("why", n=3)["decisions"]
