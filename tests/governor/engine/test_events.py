"""`GET /engine/events` on a real engine process: the status pushed on change, nothing while idle, and an idle
engine whose threads sleep."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from governor.engine.client import EngineClient, EngineStatus, EngineUnavailable
from tests.governor.engine.engine_proc import Engine, user
from tests.helpers import eventually

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(demo_ladder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    directory = tmp_path_factory.mktemp("events")
    eng = Engine(directory, "--models", str(demo_ladder), "--tier", "small", "--threads", "1")
    yield eng
    assert eng.stop() == 0, eng.log()


class Reader(threading.Thread):
    """Collects the stream's statuses on a thread, as the daemon's watch does."""

    def __init__(self, client: EngineClient, heartbeat_s: float | None = None) -> None:
        super().__init__(daemon=True)
        self.client, self.heartbeat_s = client, heartbeat_s
        self.lines: list[EngineStatus] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            for status in self.client.events(heartbeat_s=self.heartbeat_s):
                self.lines.append(status)
        except EngineUnavailable as exc:
            self.error = exc


def run_wakeups(pid: int) -> int:
    """How many times any thread of `pid` has been scheduled (the run count in /proc/PID/task/*/schedstat)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[2])
        except (OSError, IndexError, ValueError):  # a thread that just ended
            continue
    return total


def test_status_is_pushed_on_change_and_not_while_idle(engine: Engine) -> None:
    with EngineClient(engine.socket) as client:
        reader = Reader(client)
        reader.start()
        first = eventually(lambda: reader.lines[0] if reader.lines else None)
        assert first is not None
        assert (first.model, first.threads, first.busy) == ("small", 1, False)

        assert engine.config(threads=2).status_code == 200
        second = eventually(lambda: reader.lines[1] if len(reader.lines) >= 2 else None)
        assert second is not None
        assert second.threads == 2  # the next line is the change: an idle engine wrote nothing in between

        r = engine.chat(model="small", messages=user("hi"), max_tokens=4, ignore_eos=True)
        assert r.status_code == 200, r.text
        eventually(lambda: [s.busy for s in reader.lines][-2:] == [True, False])

        client.interrupt_streams()
        reader.join(10)
        assert isinstance(reader.error, EngineUnavailable)
        assert engine.config(threads=1).status_code == 200


def test_heartbeat_lines_and_a_bad_heartbeat(engine: Engine) -> None:
    with EngineClient(engine.socket) as client:
        reader = Reader(client, heartbeat_s=0.1)
        reader.start()
        # Once the loaded model's RSS settles, a heartbeat brings nothing new: a blank line, read as the last status
        # again (the same object: no JSON parsed).
        eventually(lambda: len(reader.lines) >= 4 and reader.lines[-1] is reader.lines[-2] is reader.lines[-3])
        client.interrupt_streams()
        reader.join(10)
    r = engine.http.get("/engine/events", params={"heartbeat_s": "0"})
    assert r.status_code == 400
    assert "heartbeat_s" in r.json()["error"]["message"]
    r = engine.http.get("/engine/events", params={"heartbeat_s": "nan"})
    assert r.status_code == 400


def test_an_idle_engine_sleeps(engine: Engine) -> None:
    """No timer in the engine: uvicorn's 0.1 s tick would wake it ten times a second."""
    with EngineClient(engine.socket) as client:
        reader = Reader(client)  # the daemon's stream is open, as it is in a governed engine
        reader.start()
        eventually(lambda: reader.lines)
        time.sleep(0.3)  # let the first line's work settle
        before = run_wakeups(engine.proc.pid)
        time.sleep(2.0)
        woke = run_wakeups(engine.proc.pid) - before
        client.interrupt_streams()
        reader.join(10)
    assert woke <= 4, f"an idle engine was scheduled {woke} times in 2 s"
