"""The control socket's `watch` stream (what `governor top` and the dashboard read), on the real server and state."""

from __future__ import annotations

import selectors
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from governor.daemon.client import ControlClient, Stream
from governor.daemon.control import WATCH_DECISIONS, ControlError
from governor.daemon.controlserver import ControlServer
from policies.decision import State
from sensors.snapshot import EngineObservation, Snapshot, Temperature, Trip
from tests.governor.daemon import test_control
from tests.governor.daemon.test_control import FakeApi, decision
from tests.helpers import eventually

api, server = test_control.api, test_control.server  # the control tests' fixtures: a FakeApi behind a real server
ZONE = Temperature(
    source="thermal_zone0", kind="thermal_zone", label="cpu", temp_c=50.0, trips=(Trip(type="passive", temp_c=80.0),)
)


def tick(api: FakeApi, t: float, state: State = State.IDLE, threads: int = 4, temp_c: float = 50.0) -> None:
    snapshot = Snapshot(temperatures=(ZONE.model_copy(update={"temp_c": temp_c}),))
    reason = f"{state.value} at {temp_c} °C"
    api.state.on_tick(t, snapshot, EngineObservation(busy=False), decision(t, state, threads, reason=reason))


def next_lines(watch: Stream, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    with selectors.DefaultSelector() as sel:
        sel.register(watch, selectors.EVENT_READ)
        assert sel.select(timeout_s), f"no watch line within {timeout_s} s"
    return watch.lines()


def test_the_status_then_after_each_tick_the_status_and_the_decisions_made_since(
    server: ControlServer, api: FakeApi
) -> None:
    tick(api, 1.0)
    with ControlClient(server.path).watch() as watch:
        first = watch.first
        assert first["ok"] is True
        assert first["status"]["state"] == "idle"
        assert [d["t"] for d in first["decisions"]] == [1.0]
        assert first["routes"] == []

        tick(api, 2.0, State.HOT, threads=2, temp_c=81.0)
        (line,) = next_lines(watch)
        assert line["status"]["state"] == "hot"
        assert line["status"]["readings"]["temperatures"][0]["temp_c"] == 81.0
        assert [(d["state"], d["reason"]) for d in line["decisions"]] == [("hot", "hot at 81.0 °C")]

        tick(api, 3.0, State.HOT, threads=2, temp_c=82.0)  # the same decision again: a status, nothing new
        (line,) = next_lines(watch)
        assert line["status"]["readings"]["temperatures"][0]["temp_c"] == 82.0
        assert line["decisions"] == []


def test_a_burst_of_ticks_comes_as_few_lines_and_loses_no_decision(server: ControlServer, api: FakeApi) -> None:
    """Hot ticks come four a second; a watcher gets at most one line a second, with every decision in between."""
    with ControlClient(server.path).watch() as watch:
        assert watch.first["decisions"] == []
        states = [State.HOT, State.SUSTAINED] * 4
        for i, state in enumerate(states):
            tick(api, 10.0 + i, state)
        got: list[dict[str, Any]] = []
        lines = 0
        while len(got) < len(states):
            for line in next_lines(watch):
                lines += 1
                got += line["decisions"]
        assert [d["t"] for d in got] == [10.0 + i for i in range(len(states))]
        assert lines < len(states)


def test_a_watcher_that_connects_late_gets_the_last_decisions(server: ControlServer, api: FakeApi) -> None:
    for i in range(WATCH_DECISIONS + 5):
        tick(api, float(i), State.HOT if i % 2 else State.IDLE)
    with ControlClient(server.path).watch() as watch:
        assert [d["t"] for d in watch.first["decisions"]] == [float(i) for i in range(5, WATCH_DECISIONS + 5)]


def test_the_stream_ends_when_the_daemon_stops(server: ControlServer, api: FakeApi) -> None:
    watch = ControlClient(server.path).watch()
    eventually(lambda: api.state._recorders)  # subscribed
    server.close()
    api.state.close_recorders()
    lines: list[dict[str, Any]] = []

    def read_to_the_end() -> None:
        while True:
            lines.extend(next_lines(watch))

    with pytest.raises(ControlError, match="closed the watch stream"):
        read_to_the_end()
    watch.close()
    assert lines == []
    assert not api.state._recorders


def test_a_stream_that_is_not_the_daemons_is_one_line_error(tmp_path: Path) -> None:
    """Whatever listens there and answers garbage or nothing, `top` and the dashboard get a ControlError to show."""
    path = tmp_path / "fake.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    answers = [b"", b"<html>\n", b'{"ok": true, "status": {}}\n\xff\xfe garbage\n']

    def serve() -> None:
        for answer in answers:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(answer)

    server_thread = threading.Thread(target=serve, daemon=True)
    server_thread.start()
    client = ControlClient(path, timeout_s=5)
    with pytest.raises(ControlError, match="closed the connection without answering"):
        client.watch()
    with pytest.raises(ControlError, match="answered something that is not JSON"):
        client.watch()
    with client.watch() as watch, pytest.raises(ControlError, match="watch stream sent something that is not JSON"):
        watch.lines()  # the garbage came with the first answer: it is read at once, not at the next tick
    server_thread.join(5)
    listener.close()


def test_watchers_share_one_status_a_tick(server: ControlServer, api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    """`governor top` and a dashboard attached: each gets the status after a tick, and the daemon builds it once."""
    tick(api, 1.0)
    built: list[str] = []
    status = api.status

    def counted() -> dict[str, Any]:
        built.append("status")
        return status()

    monkeypatch.setattr(api, "status", counted)
    with ControlClient(server.path).watch() as top, ControlClient(server.path).watch() as dashboard:
        built.clear()  # each watcher's first line is its own
        tick(api, 2.0, State.HOT, threads=2, temp_c=81.0)
        (a,) = next_lines(top)
        (b,) = next_lines(dashboard)
    assert a["status"] == b["status"]
    assert a["status"]["state"] == "hot"
    assert a["decisions"] == b["decisions"] != []
    assert built == ["status"]
