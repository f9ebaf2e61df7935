"""The daemon as a real process: a fake device tree, the demo ladder, a real engine child, real sockets."""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any

import pytest

from govbase.errors import GovernorError
from tests.governor.daemon.daemon_proc import INTERVAL_S, DaemonProc
from tests.helpers import eventually

pytestmark = pytest.mark.slow

ZONE_TEMP = "sys/class/thermal/thermal_zone0/temp"
PROMPT = [{"role": "user", "content": "Tell me a long story."}]


class Stream(threading.Thread):
    """A streamed chat running while the device changes under it."""

    def __init__(self, daemon: DaemonProc, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.d, self.max_tokens = daemon, max_tokens
        self.chunks: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            model = self.d.engine.status().model
            body = {"max_tokens": self.max_tokens, "ignore_eos": True, "stream_options": {"include_usage": True}}
            for chunk in self.d.engine.stream_chat(PROMPT, model=model, **body):
                self.chunks.append(chunk)
        except GovernorError as exc:  # reported by the test, which asserts there was none (or expects one)
            self.error = exc

    @property
    def pieces(self) -> int:
        return sum(1 for c in self.chunks if c.get("choices") and c["choices"][0]["delta"].get("content"))

    @property
    def tokens(self) -> int | None:
        """The answer's tokens, from the usage chunk (a chunk can carry several tokens: the stream interval)."""
        return next((c["usage"]["completion_tokens"] for c in self.chunks if c.get("usage")), None)

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0].get("finish_reason") for c in self.chunks if c.get("choices")]
        return next((r for r in reasons if r), None)


def test_heat_then_cool_then_pull_the_charger(daemon: DaemonProc) -> None:
    status = daemon.status()
    assert status["state"] == "idle"
    assert daemon.engine_threads() == 4

    stream = Stream(daemon, max_tokens=240)
    stream.start()
    eventually(lambda: stream.pieces >= 5, timeout_s=30)

    # Heat: the engine's threads drop within two poll intervals, live, while the answer streams on.
    heated = time.monotonic()
    daemon.tree.write(ZONE_TEMP, 90000)
    eventually(lambda: daemon.engine_threads() < 4, timeout_s=2 * INTERVAL_S + 0.5, interval_s=0.01)
    took_s = time.monotonic() - heated
    hot = daemon.status()
    assert hot["state"] == "hot", hot["reason"]
    assert "hot" in hot["reason"]
    assert "90" in hot["reason"]  # the reading that made it fire
    assert stream.is_alive(), "the stream should still be going when the threads drop"
    print(f"threads dropped {took_s:.2f} s after the zone crossed (interval {INTERVAL_S} s)")

    # Cool: back one thread at a time.
    cooled_wall = time.time()
    daemon.tree.write(ZONE_TEMP, 45000)
    eventually(lambda: daemon.engine_threads() == 4, timeout_s=30)
    decisions = daemon.client.request("why", n=100)["decisions"]
    threads = [d["engine"]["threads"] for d in decisions if d["wall"] >= cooled_wall]
    steps = [b - a for a, b in itertools.pairwise(threads) if b != a]
    assert threads[-1] == 4
    assert steps, threads
    assert all(step == 1 for step in steps), f"threads came back as {threads}"

    stream.join(120)
    assert stream.error is None
    assert stream.finish_reason == "length"
    assert stream.tokens == 240  # the whole answer arrived through the heat and the cool-down

    # Pull the charger at 15 %: low_battery.
    daemon.tree.write("sys/class/power_supply/AC/online", 0)
    daemon.tree.write("sys/class/power_supply/BAT0/status", "Discharging")
    status = eventually(lambda: (s := daemon.status())["state"] == "low_battery" and s, timeout_s=10)
    assert "15" in status["reason"]
    eventually(lambda: daemon.engine_threads() == 2)


class Recorder(threading.Thread):
    """The daemon's `record` stream: one trace line per tick."""

    def __init__(self, daemon: DaemonProc, seconds: float) -> None:
        super().__init__(daemon=True)
        self.d, self.seconds = daemon, seconds
        self.ticks: list[dict[str, Any]] = []

    def run(self) -> None:
        for line in self.d.client.record(seconds=self.seconds):
            self.ticks.append(json.loads(line))

    def calm_gap(self) -> bool:
        """Two idle ticks in a row at least four seconds apart (the calm interval is 5 s)."""
        pairs = itertools.pairwise(self.ticks)
        return any(b["t"] - a["t"] >= 4.0 and a["engine"] and not a["engine"]["busy"] for a, b in pairs)


def test_a_calm_daemon_ticks_slowly_and_a_request_wakes_it(daemon: DaemonProc) -> None:
    daemon.tree.write("sys/class/power_supply/BAT0/capacity", 80)  # far from low battery: nothing to watch closely
    recorder = Recorder(daemon, seconds=60)
    recorder.start()
    eventually(recorder.calm_gap, timeout_s=30, interval_s=0.1)

    # An 8-token answer takes a fraction of a second, far less than a calm tick: only the engine's word that it
    # turned busy makes the loop tick while it runs.
    asked = len(recorder.ticks)
    model = daemon.engine.status().model
    answer = daemon.engine.chat(PROMPT, model=model, max_tokens=8, ignore_eos=True)
    assert answer["choices"][0]["finish_reason"] == "length"
    busy = eventually(lambda: [r for r in recorder.ticks[asked:] if r["engine"] and r["engine"]["busy"]], timeout_s=3)
    assert busy
    eventually(lambda: not recorder.ticks[-1]["engine"]["busy"], timeout_s=3)  # and the return to idle, at once too
