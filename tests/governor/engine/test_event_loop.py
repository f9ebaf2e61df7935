"""The engine's event loop never blocks: a real engine in asyncio debug mode (`--slow-callback-ms`), taken through
chats, a stream and every kind of reconfiguration while its status is polled; every loop step that took longer
than the threshold is a logged `engine.slow_callback`, and there must be none."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.governor.engine.engine_proc import Engine, user
from tests.helpers import eventually

pytestmark = pytest.mark.slow

THRESHOLD_MS = 50


class StatusPoller:
    """GET /engine/status over and over on its own connection, as the daemon does (but much more often)."""

    def __init__(self, socket: Path) -> None:
        self.answers: list[int] = []
        self._stop = threading.Event()
        self._http = httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://engine", timeout=60)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.answers.append(self._http.get("/engine/status").status_code)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(60)
        self._http.close()
        return self.answers


@pytest.fixture
def engine(demo_ladder: Path, tmp_path: Path) -> Iterator[Engine]:
    # Starts on medium with an f16 KV cache: the first change to a quantized KV type is the first time this process
    # needs to know the file's head size (medium), and then another file's (large) before loading it.
    eng = Engine(
        tmp_path,
        "--models",
        str(demo_ladder),
        "--tier",
        "medium",
        "--threads",
        "1",
        "--slow-callback-ms",
        str(THRESHOLD_MS),
    )
    yield eng
    assert eng.stop() == 0, eng.log()


CHANGES: list[dict[str, Any]] = [
    {"threads": 2},
    {"max_tokens_per_s": 40},
    {"n_ctx": 1024},
    {"kv_type": "q8_0"},
    {"model": "large", "kv_type": "q4_0"},
    {"model": "small", "kv_type": "f16"},
    {"threads": 1, "n_ctx": 2048},
]


def test_no_loop_step_blocks_through_chats_reconfiguration_and_polling(engine: Engine) -> None:
    poller = StatusPoller(engine.socket)
    assert engine.config(max_tokens_per_s=30).status_code == 200
    r = engine.chat(messages=user("hello"), max_tokens=8, ignore_eos=True)
    assert r.status_code == 200, r.text
    thread, seen = engine.stream_in_thread({"messages": user("go on"), "max_tokens": 150, "ignore_eos": True})
    eventually(lambda: len(seen.arrivals) >= 3, timeout_s=60)
    for change in CHANGES:
        r = engine.config(**change)
        assert r.status_code == 200, (change, r.text)
        target = len(seen.arrivals) + 3  # the answer goes on after each change
        eventually(lambda: len(seen.arrivals) >= target, timeout_s=60)  # noqa: B023 (called before the next change)
    thread.join(120)
    assert seen.done
    assert seen.finish_reason == "length"
    r = engine.chat(messages=user("bye"), max_tokens=8, ignore_eos=True)
    assert r.status_code == 200, r.text
    answers = poller.stop()
    assert len(answers) > 20
    assert set(answers) == {200}
    assert engine.status()["reloads_total"] == 5
    assert engine.log_events("engine.asyncio") == []
    slow = engine.log_events("engine.slow_callback")
    assert slow == [], "\n".join(f"{e['seconds']} s: {e['callback'][:300]}" for e in slow)


def test_slow_loop_steps_are_reported(demo_ladder: Path, tmp_path: Path) -> None:
    """The report the test above relies on: with a 0.01 ms threshold every request has slow steps."""
    eng = Engine(
        tmp_path, "--models", str(demo_ladder), "--tier", "small", "--threads", "1", "--slow-callback-ms", "0.01"
    )
    try:
        assert eng.chat(messages=user("hello"), max_tokens=4).status_code == 200
        slow = eventually(lambda: eng.log_events("engine.slow_callback"))
        assert all(e["seconds"] >= 0 for e in slow)
        assert any("Task" in e["callback"] or "Handle" in e["callback"] for e in slow)
    finally:
        assert eng.stop() == 0, eng.log()
