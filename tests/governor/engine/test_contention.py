"""A config change lands within one token while the engine's two threads share one core with a CPU hog (the
contention issue's situation): the engine reports how many tokens it generated between a change's arrival and its
application, and that is at most the one in flight."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.governor.engine.engine_proc import Engine, user
from tests.helpers import eventually

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is needed to share one core"),
]

ONE_CORE = ("taskset", "-c", "0")


@pytest.fixture
def hog() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([*ONE_CORE, sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_thread_change_lands_within_one_slow_token(
    demo_ladder: Path, tmp_path: Path, hog: subprocess.Popen[bytes]
) -> None:
    engine = Engine(
        tmp_path, "--models", str(demo_ladder), "--tier", "small", "--threads", "2", "--drain-s", "0", wrap=ONE_CORE
    )
    try:
        body = {"model": "small", "messages": user("go on"), "max_tokens": 100_000, "ignore_eos": True}
        thread, seen = engine.stream_in_thread(body)
        eventually(lambda: len(seen.arrivals) >= 3, timeout_s=120)
        for threads in (1, 2, 1, 2, 1):
            r = engine.config(threads=threads)
            assert r.status_code == 200, r.text
            assert r.json()["applied"] == "live"
            # The token being computed when the change arrived finishes first; the change lands before the next.
            assert r.json()["tokens_waited"] <= 1
            after = engine.status()
            assert after["threads"] == threads
            assert after["busy"] is True  # the answer goes on
    finally:
        code = engine.stop()  # ends the running answer at a token boundary
    thread.join(60)
    assert code == 0, engine.log()
    assert seen.finish_reason == "length"
