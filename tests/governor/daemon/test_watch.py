"""EngineWatch: the engine's pushed status as the loop reads it, with a small fake stream source."""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from pathlib import Path

from governor.daemon.watch import EngineWatch
from governor.engine.client import EngineStatus, EngineUnavailable
from tests.helpers import eventually

END = None  # queued by a test: the stream ends (the engine went away)


def status(*, busy: bool = False, model: str = "small", threads: int = 2) -> EngineStatus:
    return EngineStatus(model=model, n_ctx=1024, kv_type="f16", threads=threads, busy=busy, rss_bytes=1 << 20)


class FakeSource:
    """Streams whatever the test queues; each stream ends at END, as an engine's does at exit."""

    def __init__(self) -> None:
        self.lines: queue.Queue[EngineStatus | None] = queue.Queue()
        self.connects = 0
        self.heartbeats: list[float | None] = []
        self.interrupted = threading.Event()

    def events(self, *, heartbeat_s: float | None = None) -> Generator[EngineStatus, None, None]:
        self.connects += 1
        self.heartbeats.append(heartbeat_s)
        while True:
            try:
                line = self.lines.get(timeout=0.02)
            except queue.Empty:
                if self.interrupted.is_set():
                    self.interrupted.clear()
                    raise EngineUnavailable(Path("engine.sock"), "interrupted") from None
                continue
            if line is None:
                raise EngineUnavailable(Path("engine.sock"), "the status stream ended")
            yield line

    def interrupt_streams(self) -> None:
        self.interrupted.set()


def test_the_latest_status_is_read_without_io_and_a_request_wakes_the_loop() -> None:
    source, wakes = FakeSource(), []
    watch = EngineWatch(source, on_change=lambda: wakes.append(1), heartbeat_s=30.0)
    assert watch.latest is None
    assert not watch.connected
    watch.kick()  # the supervisor says the engine is ready: connect
    try:
        source.lines.put(status())
        eventually(lambda: watch.latest is not None)
        assert watch.connected
        assert source.heartbeats == [30.0]
        assert len(wakes) == 1  # connected: tick with the engine's status

        source.lines.put(status(threads=1))  # a settings change the loop did itself: no extra wake-up
        eventually(lambda: watch.lines == 2)
        assert len(wakes) == 1

        source.lines.put(status(busy=True))  # a request arrived
        eventually(lambda: watch.latest is not None and watch.latest.busy)
        assert len(wakes) == 2
        assert watch.last_seen_s is not None
    finally:
        watch.close()
    assert not watch._thread.is_alive()


def test_a_heartbeat_with_nothing_new_says_the_engine_lives_and_nothing_else() -> None:
    source, wakes, now = FakeSource(), [], [100.0]
    watch = EngineWatch(source, on_change=lambda: wakes.append(1), heartbeat_s=5.0, monotonic=lambda: now[0])
    watch.kick()
    try:
        first = status()
        source.lines.put(first)
        eventually(lambda: watch.lines == 1)
        seen = watch.latest
        now[0] = 105.0
        source.lines.put(first)  # the client's reading of a blank heartbeat line: the last status, the same object
        eventually(lambda: watch.lines == 2)
        assert watch.last_seen_s == 105.0
        assert watch.fresh(1.0) is first
        assert watch.latest is seen  # not rebuilt
        assert len(wakes) == 1
    finally:
        watch.close()


def test_a_lost_engine_reads_as_none_and_the_watch_reconnects() -> None:
    source, wakes = FakeSource(), []
    watch = EngineWatch(source, on_change=lambda: wakes.append(1))
    watch.kick()
    try:
        source.lines.put(status())
        eventually(lambda: watch.connected)
        source.lines.put(END)  # the engine died
        eventually(lambda: watch.latest is None)
        assert len(wakes) == 2  # gone: the loop hears it at once
        watch.kick()  # the new engine is ready
        source.lines.put(status(model="large"))
        eventually(lambda: watch.latest is not None and watch.latest.model == "large")
        assert source.connects >= 2
    finally:
        watch.close()
