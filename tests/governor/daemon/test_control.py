from __future__ import annotations

import grp
import json
import os
import queue
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from governor.clock import RealClock
from governor.daemon.client import ControlClient
from governor.daemon.control import ControlError
from governor.daemon.controlserver import ControlServer
from governor.daemon.holds import HoldRegistry
from governor.daemon.state import DaemonState
from policies.decision import Decision, EngineConfig, Hold, State
from sensors.snapshot import EngineObservation, Snapshot, TraceRecord
from tests.helpers import eventually

CFG = EngineConfig(threads=4, n_ctx=2048, model="large")


def decision(t: float, state: State = State.IDLE, threads: int = 4, reason: str = "idle: nothing running") -> Decision:
    return Decision(t=t, state=state, engine=CFG.model_copy(update={"threads": threads}), reason=reason, rule="r")


class FakeApi:
    """The daemon side of the control API, on the real registry and state."""

    def __init__(self) -> None:
        self.clock = RealClock()
        self.woken = threading.Event()
        self.holds = HoldRegistry(on_change=self.woken.set)
        self.state = DaemonState()
        self.reloads = 0

    def now(self) -> float:
        return self.clock.now()

    def status(self) -> dict[str, Any]:
        return self.state.view() | {"holds": [h.model_dump(mode="json") for h in self.holds.all().values()]}

    def why(self, n: int) -> list[dict[str, Any]]:
        return self.state.recent(n)

    def routes(self, n: int) -> list[dict[str, Any]]:
        return []

    def reload(self) -> dict[str, Any]:
        self.reloads += 1
        return {"ok": False, "error": "reload failed, kept the last good policy: p.toml:3: typo"}

    def metrics(self) -> str:
        return "governor_ticks_total 3.0\n"

    def add_hold(self, hold: Hold) -> int:
        return self.holds.add(hold)

    def release_hold(self, cookie: int) -> None:
        self.holds.release(cookie)

    def subscribe(self) -> queue.Queue[TraceRecord | None]:
        return self.state.subscribe()

    def unsubscribe(self, q: queue.Queue[TraceRecord | None]) -> None:
        self.state.unsubscribe(q)


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def server(sock_dir: Path, api: FakeApi) -> Iterator[ControlServer]:
    srv = ControlServer(sock_dir / "control.sock", api)
    srv.start()
    yield srv
    srv.close()


def test_socket_is_owner_only_by_default(server: ControlServer) -> None:
    mode = stat.S_IMODE(os.stat(server.path).st_mode)
    assert stat.S_ISSOCK(os.stat(server.path).st_mode)
    assert mode == 0o600


def test_a_group_makes_it_0660(sock_dir: Path, api: FakeApi) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    srv = ControlServer(sock_dir / "g.sock", api, group=group)
    try:
        st = os.stat(srv.path)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getgid()
    finally:
        srv.close()


def test_unknown_group_is_one_clear_error(sock_dir: Path, api: FakeApi) -> None:
    with pytest.raises(ControlError, match="group 'no-such-group-here' does not exist"):
        ControlServer(sock_dir / "g.sock", api, group="no-such-group-here")


def test_a_stale_socket_is_replaced_and_a_live_one_refused(sock_dir: Path, api: FakeApi) -> None:
    path = sock_dir / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # bound, never listening: what a killed daemon leaves behind
    first = ControlServer(path, api)
    first.start()
    try:
        with pytest.raises(ControlError, match="another governor is already listening"):
            ControlServer(path, api)
    finally:
        first.close()
    assert not path.exists()


def test_a_file_that_is_not_a_socket_is_never_removed(sock_dir: Path, api: FakeApi) -> None:
    path = sock_dir / "control.sock"
    path.write_text("somebody's notes")
    with pytest.raises(ControlError, match="exists and is not a socket; not removing it"):
        ControlServer(path, api)
    assert path.read_text() == "somebody's notes"


def test_status_why_metrics_and_reload(server: ControlServer, api: FakeApi) -> None:
    api.state.on_tick(1.0, Snapshot(), EngineObservation(busy=True, tokens_per_s=9.5), decision(1.0))
    api.state.on_tick(2.0, Snapshot(), None, decision(2.0, State.HOT, 2, "hot: 81 °C ≥ 76 °C; threads 4→2"))
    api.state.on_tick(3.0, Snapshot(), None, decision(3.0, State.HOT, 2, "hot: 81 °C ≥ 76 °C; threads 4→2"))
    client = ControlClient(server.path)
    status = client.request("status")["status"]
    assert status["state"] == "hot"
    assert status["config"]["threads"] == 2
    assert status["ticks"] == 3
    why = client.request("why", n=5)["decisions"]
    assert [d["state"] for d in why] == ["idle", "hot"]  # repeats of one decision are one entry
    assert why[-1]["reason"] == "hot: 81 °C ≥ 76 °C; threads 4→2"
    assert client.request("metrics")["text"] == "governor_ticks_total 3.0\n"
    with pytest.raises(ControlError, match="kept the last good policy"):
        client.request("reload")
    assert api.reloads == 1


def test_bad_requests_get_one_line_and_the_server_keeps_serving(server: ControlServer) -> None:
    client = ControlClient(server.path)
    with pytest.raises(ControlError, match="unknown command 'fly'"):
        client.request("fly")
    with pytest.raises(ControlError, match="bad request: unknown state 'sleepy'; expected one of idle, sustained"):
        client.request("hold", state="sleepy")
    with pytest.raises(ControlError, match="bad request: max_threads: Input should be greater than or equal to 1"):
        client.request("hold", max_threads=0)
    with pytest.raises(ControlError, match="a hold needs a state"):
        client.request("hold")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(server.path))
        raw.sendall(b"{not json\n")
        assert json.loads(raw.makefile().readline())["ok"] is False
    assert client.request("status")["ok"]


def test_a_hold_lasts_as_long_as_its_connection(server: ControlServer, api: FakeApi) -> None:
    client = ControlClient(server.path)
    with client.hold(state="idle", max_threads=2) as (answer, _events):
        assert answer["ok"]
        (hold,) = api.holds.in_force(api.now())
        assert hold.state == State.IDLE
        assert hold.max_threads == 2
        assert hold.owner.startswith(f"pid {os.getpid()} ")  # who holds it, from the socket's peer credentials
        assert api.woken.is_set()  # the loop is told at once
    eventually(lambda: api.holds.in_force(api.now()) == ())


def test_an_error_inside_a_hold_is_the_callers_not_the_daemons(server: ControlServer, api: FakeApi) -> None:
    """The `with` block's own ValueError stays one (it read as "the governor answered something that is not JSON"),
    and the hold is released all the same."""
    with pytest.raises(ValueError, match="the caller's"), ControlClient(server.path).hold(state="idle"):
        raise ValueError("the caller's")
    eventually(lambda: api.holds.in_force(api.now()) == ())


def test_a_hold_ends_at_its_ttl_and_says_so(server: ControlServer, api: FakeApi) -> None:
    client = ControlClient(server.path)
    with client.hold(max_tokens_per_s=3.0, ttl_s=0.3) as (answer, events):
        assert answer["expires_t"] is not None
        assert next(events) == {"event": "released", "why": "ttl"}
    assert api.holds.in_force(api.now()) == ()


def test_closing_the_server_releases_holds(sock_dir: Path, api: FakeApi) -> None:
    srv = ControlServer(sock_dir / "c.sock", api)
    srv.start()
    with ControlClient(srv.path).hold(state="idle") as (_answer, events):
        assert len(api.holds.all()) == 1
        srv.close()
        assert list(events) in ([], [{"event": "released", "why": "shutdown"}])
    eventually(lambda: api.holds.all() == {})
    assert not srv.path.exists()
    with pytest.raises(ControlError, match="cannot reach the governor"):
        ControlClient(srv.path).request("status")


def test_record_streams_trace_lines(server: ControlServer, api: FakeApi) -> None:
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(ControlClient(server.path).record(seconds=5.0)))
    reader.start()
    eventually(lambda: api.state._recorders)  # subscribed
    for t in (1.0, 2.0):
        api.state.on_tick(t, Snapshot(), EngineObservation(busy=True, tokens_per_s=5.0), decision(t))
    eventually(lambda: len(lines) == 2)
    api.state.close_recorders()
    reader.join(5)
    records = [TraceRecord.model_validate_json(line) for line in lines]
    assert [r.t for r in records] == [1.0, 2.0]
    assert records[0].engine is not None
    assert records[0].engine.tokens_per_s == 5.0


def test_prometheus_over_http_on_the_same_socket(server: ControlServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(server.path))
        raw.sendall(b"GET /metrics HTTP/1.1\r\nHost: governor\r\n\r\n")
        answer = raw.makefile("rb").read().decode()
    assert answer.startswith("HTTP/1.0 200 OK\r\n")
    assert "text/plain; version=0.0.4" in answer
    assert answer.endswith("governor_ticks_total 3.0\n")


def test_client_waits_out_a_full_backlog(tmp_path: Path) -> None:
    """Another user fills the listen backlog: connect() says EAGAIN at once. The client retries until the daemon
    accepts (here 0.3 s later) instead of reporting an unreachable governor."""
    path = tmp_path / "c.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(0)
    server.settimeout(10)  # without the retry the client never comes: the thread must end anyway
    fillers: list[socket.socket] = []
    while True:  # fill the backlog the way a flood does
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        filler.setblocking(False)
        try:
            filler.connect(str(path))
        except BlockingIOError:
            filler.close()
            break
        fillers.append(filler)

    def serve_late() -> None:
        time.sleep(0.3)  # the daemon is busy; it gets to its accept queue late
        for _ in fillers:
            server.accept()[0].close()
        try:
            conn, _ = server.accept()
        except TimeoutError:
            return
        with conn, conn.makefile("rb") as lines:
            assert json.loads(lines.readline())["cmd"] == "status"
            conn.sendall(b'{"ok": true, "state": "idle"}\n')

    thread = threading.Thread(target=serve_late)
    thread.start()
    try:
        assert ControlClient(path, timeout_s=10).request("status")["state"] == "idle"
    finally:
        thread.join(10)
        for filler in fillers:
            filler.close()
        server.close()
