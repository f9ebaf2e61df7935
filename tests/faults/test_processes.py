"""Process-level faults on the victim daemon: its engine killed or stopped, its file descriptors exhausted, its
control socket flooded; plus the socket directory another user prepared. The daemon notices, recovers, says so."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from governor.daemon.control import READ_TIMEOUT_S, ControlError
from governor.daemon.controlserver import MAX_CONNECTIONS, ControlServer
from governor.engine.client import EngineClient
from tests.faults.conftest import FAULT_POLICY, opened_to_others
from tests.governor.daemon.daemon_proc import DaemonProc
from tests.helpers import eventually

pytestmark = pytest.mark.slow
FAULT_KIND = "processes and sockets"
HELLO = [{"role": "user", "content": "hello"}]


def engine_pid(victim: DaemonProc) -> int:
    pid = eventually(lambda: victim.status()["supervisor"]["pid"], timeout_s=60)
    assert isinstance(pid, int)
    return pid


def serving_again(victim: DaemonProc, old_pid: int) -> dict[str, object]:
    def check() -> dict[str, object]:
        status = victim.status()
        sup = status["supervisor"]
        assert sup["pid"] not in (None, old_pid), sup
        assert sup["ready"], sup
        assert status["engine"], sup
        return status

    status = eventually(check, timeout_s=90, interval_s=0.1)
    answer = victim.engine.chat(HELLO, model=victim.engine.status().model, max_tokens=4)
    assert answer["usage"]["completion_tokens"] > 0
    return status


def test_kill_9_of_the_engine_is_restarted(victim: DaemonProc) -> None:
    pid = engine_pid(victim)
    os.kill(pid, signal.SIGKILL)
    status = serving_again(victim, pid)
    assert "killed by SIGKILL" in str(status["supervisor"]["last_exit"])  # type: ignore[index]


def test_a_stopped_engine_is_noticed_killed_and_restarted(victim: DaemonProc) -> None:
    pid = engine_pid(victim)
    os.kill(pid, signal.SIGSTOP)
    try:
        # While it is silent, status does not claim it is ready.
        eventually(lambda: not victim.status()["supervisor"]["ready"], timeout_s=10)
        status = serving_again(victim, pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert "hung" in str(status["supervisor"]["last_exit"])  # type: ignore[index]


def test_a_failed_start_at_the_fd_limit_is_retried(victim: DaemonProc) -> None:
    """With no file descriptor left the engine cannot be started (EMFILE): supervision reports it and retries, and
    the engine comes back once descriptors are free again."""
    daemon = victim.proc.pid
    soft, hard = resource.prlimit(daemon, resource.RLIMIT_NOFILE)
    pid = engine_pid(victim)
    # A limit of 0: no descriptor number is free whatever the daemon closes meanwhile. A limit of "how many are open"
    # (or of the lowest free number) raced with the descriptors the dying engine releases (its pipes, connections),
    # which could let the restart through.
    resource.prlimit(daemon, resource.RLIMIT_NOFILE, (0, hard))
    try:
        os.kill(pid, signal.SIGKILL)
        # Meanwhile the control socket cannot accept either: the daemon's log is where to look. A client now wakes its
        # accept loop, whose next select() fails too (poll() watches more descriptors than the limit): the loop, and
        # with it the control socket, must outlive that (its thread died of it, and no request was answered again).
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as poke:
            poke.connect(str(victim.control))
        eventually(lambda: any(e.get("event") == "engine could not start" for e in victim.events()), timeout_s=30)
    finally:
        resource.prlimit(daemon, resource.RLIMIT_NOFILE, (soft, hard))
    serving_again(victim, pid)
    assert victim.status()["errors"]["loop"] == 0


def test_a_connection_flood_is_capped_and_idle_ones_are_closed(victim: DaemonProc) -> None:
    daemon = victim.proc.pid
    before = len(os.listdir(f"/proc/{daemon}/fd"))
    flood: list[socket.socket] = []
    try:
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(victim.control))
            flood.append(sock)
        open_fds = len(os.listdir(f"/proc/{daemon}/fd"))
        assert open_fds < before + 2 * MAX_CONNECTIONS + 10  # capped, not one per connection
        victim.check_alive()
        # Idle connections are closed by the daemon after its read timeout: the socket sees EOF.
        for sock in flood[:5]:
            sock.settimeout(READ_TIMEOUT_S + 10)
            assert sock.recv(100) in (b"", b'{"ok": false, "error": "too many connections; try again later"}\n')
    finally:
        for sock in flood:
            sock.close()
    assert eventually(lambda: victim.status()["state"], timeout_s=30)


def test_a_hostile_runtime_directory_is_refused(tmp_path: Path) -> None:
    """Another user prepared the socket directory (mode 0777): the daemon refuses it instead of using it."""
    hostile = tmp_path / "governor-0"
    hostile.mkdir()
    os.chmod(hostile, 0o777)
    with pytest.raises(ControlError, match="writable by group and others"):
        ControlServer(hostile / "control.sock", api=None)  # type: ignore[arg-type]
    os.chmod(hostile, 0o755)
    os.chown(hostile, 65534, 65534)
    with pytest.raises(ControlError, match="owned by uid 65534"):
        ControlServer(hostile / "control.sock", api=None)  # type: ignore[arg-type]


def test_the_client_skips_a_hostile_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The client looks where the daemon would, and never talks to a socket in a directory others can write."""
    from governor.daemon.cli import default_control_socket

    hostile = tmp_path / "run" / "governor"
    hostile.mkdir(parents=True)
    os.chmod(hostile, 0o777)
    (hostile / "control.sock").touch()
    chosen = default_control_socket({"XDG_RUNTIME_DIR": str(tmp_path / "run")}, euid=1000)
    assert chosen == Path("/run/governor/control.sock")
    assert f"not using {hostile / 'control.sock'}" in capsys.readouterr().err


def test_engine_config_drift_is_corrected(victim: DaemonProc) -> None:
    """Someone posts straight to the engine's own socket (the daemon's user: the public one refuses it): the daemon
    notices at its next probe and applies its own config again."""
    wanted = victim.status()["config"]["threads"]
    with EngineClient(victim.engine_socket.with_name("e-child.sock")) as engine:
        engine.configure(threads=1 if wanted != 1 else 2)
    eventually(lambda: victim.engine_threads() == wanted, timeout_s=20)
    assert any(e.get("event", "").startswith("engine config drifted") for e in victim.events())


def test_a_second_daemon_never_takes_over_the_engine(victim: DaemonProc, tmp_path: Path, demo_ladder: Path) -> None:
    sockets = Path(tempfile.mkdtemp(prefix="gv2", dir="/tmp"))
    # The same engine socket as the victim's: the engine child's private one (the public one is the daemon's own)
    (sockets / "e-child.sock").symlink_to(victim.engine_socket.with_name("e-child.sock"))
    second = DaemonProc(
        tmp_path / "second", sockets, demo_ladder, policy=FAULT_POLICY.replace("threads = 4", "threads = 3")
    )
    try:
        eventually(
            lambda: any(
                e.get("event") == "another engine answers on our socket; not using it" for e in second.events()
            ),
            timeout_s=60,
        )
        assert not second.status()["supervisor"]["ready"]
        assert victim.engine_threads() == 4  # the victim's engine kept the victim's config
    finally:
        second.stop()
        shutil.rmtree(sockets, ignore_errors=True)
    victim.status()


FLOODER = """
import os, socket, sys, time
os.setgid(65534); os.setuid(65534)  # another local user, allowed onto the socket (as a group member would be)
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[1])
    except OSError:
        break
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()  # hold them until told to stop
"""


@contextlib.contextmanager
def flooded(victim: DaemonProc, path: Path, n: int = 1000) -> Iterator[None]:
    """Another user (uid 65534, let onto `path` as a group member would be) holds `n` connections to it that send
    nothing; asserted meanwhile: the daemon's descriptors stay bounded."""
    with opened_to_others(path):
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, str(path), str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert flooder.stdout is not None
            assert int(flooder.stdout.readline()) > 0
            fds = len(os.listdir(f"/proc/{victim.proc.pid}/fd"))
            assert fds < 400  # the daemon's limit is 1024 by default: far from it
            yield
        finally:
            flooder.communicate("", timeout=30)


def test_another_users_flood_leaves_root_served(victim: DaemonProc) -> None:
    """The issue's exhaustion path: a non-root user with access to the socket opens connections and sends nothing.
    It gets at most the cap; root's `governor status` still answers, and the daemon's descriptors stay bounded."""
    with flooded(victim, victim.control):
        assert victim.status()["state"]  # root is served at once, during the flood


def test_a_file_at_the_engine_socket_is_one_clear_line(tmp_path: Path, demo_ladder: Path) -> None:
    sockets = Path(tempfile.mkdtemp(prefix="gv3", dir="/tmp"))
    (sockets / "e.sock").write_text("not a socket")
    d = DaemonProc(tmp_path, sockets, demo_ladder)
    try:
        assert d.proc.wait(60) == 2
        assert (
            d.log()
            .strip()
            .endswith(f"{sockets / 'e.sock'}: exists and is not a socket; the engine cannot listen there")
        )
        assert (sockets / "e.sock").read_text() == "not a socket"  # never removed
    finally:
        d.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def test_another_users_flood_of_the_engine_socket_leaves_chats_served(victim: DaemonProc) -> None:
    """The public engine socket (0660 and its group's, when `group` is set): a member opening connections and sending
    nothing gets a quarter of the cap; the daemon's descriptors stay bounded, root's chat and status are answered
    during the flood, and a connection that says nothing is closed after the read timeout."""
    with flooded(victim, victim.engine_socket):
        model = victim.status()["config"]["model"]
        answer = victim.engine.chat([{"role": "user", "content": "hi"}], model=model, max_tokens=4)
        assert answer["choices"][0]["message"]["content"] is not None  # root is served during the flood
        assert victim.status()["state"]
    refused = [e for e in victim.events() if e.get("event") == "engine socket connection refused"]
    assert refused
    assert "from uid 65534" in refused[0]["reason"]  # the administrator can see who and why
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(victim.engine_socket))
        silent.settimeout(READ_TIMEOUT_S + 10)
        assert silent.recv(100) == b""  # closed by the daemon, not left open for good
