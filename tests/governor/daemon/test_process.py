"""The daemon process's contracts: supervision, reload, sd_notify, holds, CLI clients (real subprocesses)."""

from __future__ import annotations

import grp
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from govbase.errors import GovernorError
from policies.replay import read_trace
from tests.governor.daemon.daemon_proc import DaemonProc, NotifySocket
from tests.helpers import eventually

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "hello"}]


def cli(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "governor", args[0], "--control-socket", str(d.control), *args[1:]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_kill_9_mid_stream_restarts_the_engine_and_serves_the_next_request(daemon: DaemonProc) -> None:
    first = daemon.status()["supervisor"]
    chunks = daemon.engine.stream_chat(HELLO, model="large", max_tokens=200, ignore_eos=True)
    next(chunks)
    os.kill(first["pid"], signal.SIGKILL)
    with pytest.raises(GovernorError):
        for _chunk in chunks:
            pass
    status = eventually(lambda: (s := daemon.status())["supervisor"]["starts"] == 2 and s["engine"] and s, timeout_s=60)
    assert status["supervisor"]["pid"] != first["pid"]
    assert status["supervisor"]["last_exit"].startswith("engine killed by SIGKILL after")
    answer = daemon.engine.chat(HELLO, model="large", max_tokens=8)
    assert answer["usage"]["completion_tokens"] > 0

    # Killed again, now while memory pressure is high: restarted one tier smaller, and the status says why.
    daemon.tree.psi(some=60.0, full=25.0)
    eventually(lambda: (daemon.status()["readings"]["memory"]["psi_some_avg10"] or 0) >= 60)
    os.kill(status["supervisor"]["pid"], signal.SIGKILL)
    status = eventually(lambda: (s := daemon.status())["supervisor"]["starts"] == 3 and s["engine"] and s, timeout_s=60)
    assert status["supervisor"]["cap"]["model"] == "medium"
    assert "memory pressure was high" in status["supervisor"]["last_exit"]
    assert daemon.engine.status().model in ("medium", "small")
    assert "capped at" in status["reason"] or status["config"]["model"] != "large"


def test_the_engine_does_not_outlive_a_killed_daemon(daemon: DaemonProc) -> None:
    """kill -9 of the daemon (the OOM killer, a hung service's last resort outside systemd's cgroup): its engine
    stops by itself, freeing its memory and socket for the next daemon's engine."""
    engine = psutil.Process(daemon.status()["supervisor"]["pid"])
    daemon.proc.kill()
    daemon.proc.wait(30)
    assert eventually(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, timeout_s=30)
    assert not daemon.engine_socket.with_name("e-child.sock").exists()  # its private socket: removed as it stopped


def test_a_second_sigterm_during_the_drain_ends_the_answer_and_exits(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path
) -> None:
    """The first SIGTERM drains: the running answer goes on (for up to drain_timeout_s, here 300 s); a second one
    ends it at the next token, and the daemon and its engine exit (uvicorn's second Ctrl-C, for a daemon)."""
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, config="drain_timeout_s = 300.0\n[restart]\ninitial_s = 0.2\n")
    try:
        d.wait_ready()
        engine_pid = d.status()["supervisor"]["pid"]
        with d.client.hold(max_tokens_per_s=4.0):  # 400 tokens at 4 tok/s: a 100 s answer
            eventually(lambda: d.engine.status().max_tokens_per_s == 4.0, timeout_s=30)
            chunks = d.engine.stream_chat(HELLO, model="large", max_tokens=400, ignore_eos=True)
            next(chunks)
            d.proc.send_signal(signal.SIGTERM)
            eventually(lambda: "drain and stop the engine" in d.log(), timeout_s=30)
            for _ in range(3):  # draining: the answer still streams
                next(chunks)
            assert d.proc.poll() is None
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(60) == 0  # far sooner than the 300 s drain
        rest = list(chunks)  # the answer ended at a token boundary: a complete response, not a cut stream
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        with pytest.raises(ProcessLookupError):
            os.kill(engine_pid, 0)
        assert "stopping now" in d.log()
    finally:
        d.stop()


def test_sighup_with_a_bad_policy_keeps_the_last_good_one(daemon: DaemonProc) -> None:
    good = daemon.policy.read_text()
    daemon.policy.write_text(good.replace("[states.idle]", "[states.idle]\nthreadz = 3"))
    daemon.proc.send_signal(signal.SIGHUP)
    status = eventually(lambda: (s := daemon.status())["policy"]["error"] and s)
    assert str(daemon.policy) in status["policy"]["error"]
    assert "threadz" in status["policy"]["error"]
    ticks = status["ticks"]
    eventually(lambda: daemon.status()["ticks"] > ticks + 2)  # still governing, on the last good policy
    assert daemon.engine_threads() == 4
    shown = cli(daemon, "status")
    assert "reload failed" in shown.stdout

    reload = cli(daemon, "reload")
    assert reload.returncode == 2
    assert "reload failed, kept the last good policy" in reload.stderr
    assert "threadz" in reload.stderr

    daemon.policy.write_text(good)
    reload = cli(daemon, "reload")
    assert reload.returncode == 0, reload.stderr
    assert daemon.status()["policy"]["error"] is None


def test_sd_notify_ready_status_watchdog_stopping(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path, notify_socket: NotifySocket
) -> None:
    env = {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "1000000"}
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, env=env)
    try:
        d.wait_ready()
        eventually(lambda: notify_socket.fields().count("WATCHDOG") >= 2, timeout_s=10)
        messages = notify_socket.drain()
        ready = next(m for m in messages if "READY" in m)
        assert ready["MAINPID"] == str(d.proc.pid)
        assert ready["STATUS"].startswith("idle")
        d.proc.send_signal(signal.SIGHUP)
        eventually(lambda: "RELOADING" in notify_socket.fields())
        eventually(lambda: notify_socket.fields().count("READY") == 2)
    finally:
        assert d.stop() == 0
    messages = notify_socket.drain()
    stopping = [i for i, m in enumerate(messages) if "STOPPING" in m]
    assert len(stopping) == 1
    assert messages[stopping[0]]["STATUS"].startswith("stopping")
    assert all("READY" not in m and "WATCHDOG" not in m for m in messages[stopping[0] :])  # the loop has ended
    assert min(i for i, m in enumerate(messages) if "READY" in m) < stopping[0]
    assert not d.control.exists()  # restored: its socket is gone


def test_mitigating_tells_systemd_a_new_state_at_once_and_a_new_reason_at_most_every_5_s(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path, notify_socket: NotifySocket
) -> None:
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, env={"NOTIFY_SOCKET": str(notify_socket.path)})
    try:
        d.wait_ready()
        d.tree.write("sys/class/thermal/thermal_zone0/temp", 90000)
        eventually(lambda: d.status()["state"] == "hot", timeout_s=30)
        eventually(lambda: any(m.get("STATUS", "").startswith("hot") for m in notify_socket.messages), timeout_s=2.5)
        hot_ticks, seen = int(d.status()["ticks"]), len(notify_socket.drain())
        eventually(lambda: int(d.status()["ticks"]) - hot_ticks >= 16, timeout_s=30)  # 4 s of 0.25 s ticks
        assert d.status()["state"] == "hot"
    finally:
        assert d.stop() == 0
    statuses = [m for m in notify_socket.drain()[seen:] if "STATUS" in m and "STOPPING" not in m]
    assert len(statuses) <= 1, statuses  # one a tick (16) before: each wakes PID 1


def test_sockets_are_owner_only_or_group_when_configured(
    daemon: DaemonProc, tmp_path: Path, sock_dir: Path, demo_ladder: Path
) -> None:
    assert stat.S_IMODE(os.stat(daemon.control).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.engine_socket).st_mode) == 0o600
    group = grp.getgrgid(os.getgid()).gr_name
    other = sock_dir / "other"
    other.mkdir()
    shared = DaemonProc(tmp_path / "g", other, demo_ladder, config=f'group = "{group}"\n')
    try:
        shared.wait_ready()
        for path in (shared.control, shared.engine_socket):
            st = os.stat(path)
            assert stat.S_IMODE(st.st_mode) == 0o660, path
            assert st.st_gid == os.getgid()
    finally:
        shared.stop()


def test_a_hold_lasts_until_its_client_dies(daemon: DaemonProc) -> None:
    argv = [sys.executable, "-m", "governor", "hold", "--max-threads", "1", "--control-socket", str(daemon.control)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            assert "in force until Ctrl-C" in holder.stdout.readline()
            eventually(lambda: daemon.engine_threads() == 1)
            (hold,) = daemon.status()["holds"]
            assert hold["max_threads"] == 1
            assert hold["owner"] == f"pid {holder.pid} uid {os.getuid()}"
        finally:
            holder.kill()  # no goodbye: the connection closing is what releases it
    eventually(lambda: daemon.status()["holds"] == [])
    eventually(lambda: daemon.engine_threads() == 4, timeout_s=30)

    shown = cli(daemon, "hold", "idle", "--ttl", "0.5")
    assert shown.returncode == 0
    assert "released (ttl)" in shown.stdout

    # `hot` overrides a hold that asks for more: "performance for this chat" does not cook the device.
    argv[argv.index("--max-threads") : argv.index("--max-threads") + 2] = ["idle"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            holder.stdout.readline()
            eventually(lambda: len(daemon.status()["holds"]) == 1)
            daemon.tree.write("sys/class/thermal/thermal_zone0/temp", 95000)
            eventually(lambda: daemon.status()["state"] == "hot")
            eventually(lambda: daemon.engine_threads() <= 2)
        finally:
            holder.kill()


def test_clients_status_why_record_metrics(daemon: DaemonProc, tmp_path: Path) -> None:
    table = cli(daemon, "status")
    assert table.returncode == 0, table.stderr
    assert "idle" in table.stdout
    assert "cpu-thermal" in table.stdout
    assert "45.0 °C" in table.stdout
    why = cli(daemon, "why", "-n", "3")
    assert "idle: engine busy" in why.stdout
    trace = tmp_path / "trace.jsonl"
    rec = cli(daemon, "record", str(trace), "--seconds", "1.5")
    assert rec.returncode == 0, rec.stderr
    with trace.open() as stream:
        records = list(read_trace(stream, trace))  # what `governor replay` reads
    assert len(records) >= 2
    assert records[0].temperatures[0].temp_c == 45.0
    assert records[0].battery is not None
    assert records[0].battery.percent == 15.0
    assert records[-1].engine is not None
    metrics = cli(daemon, "metrics").stdout
    assert 'governor_state{state="idle"} 1.0' in metrics
    assert 'governor_temperature_celsius{label="cpu-thermal",source="thermal_zone0"} 45.0' in metrics
    assert "governor_engine_threads 4.0" in metrics


def test_unreachable_daemon_is_one_line(sock_dir: Path) -> None:
    argv = [sys.executable, "-m", "governor", "status", "--control-socket", str(sock_dir / "none.sock")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"governor: error: cannot reach the governor at {sock_dir / 'none.sock'}")
    assert len(result.stderr.strip().splitlines()) == 1
