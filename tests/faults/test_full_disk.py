"""Full filesystems (issue 33): small tmpfs mounts (root: as CI runs) under the metrics textfile, the daemon's log,
the state directory and `governor record`. A write that fails (ENOSPC) costs that file, never a tick, READY, a
decision or a traceback; once there is room again the file is written again."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from governor.daemon.client import ControlClient
from governor.daemon.control import ControlError
from governor.daemon.freqcap import CPUFREQ, FreqCap
from sensors.root import Root
from tests.faults.conftest import FAULT_CONFIG, FAULT_POLICY
from tests.governor.daemon.daemon_proc import DaemonProc, NotifySocket, device_tree
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

pytestmark = pytest.mark.slow
FAULT_KIND = "full filesystems"
ZONE_TEMP = "sys/class/thermal/thermal_zone0/temp"


class Tmpfs:
    """A 256 KiB tmpfs, filled to the last block by `fill()` and emptied again by `free()`."""

    def __init__(self, path: Path, size: str = "256k") -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        argv = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
        done = subprocess.run(argv, check=False, capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root, as in CI): {done.stderr.decode().strip()}")

    def fill(self) -> None:
        with contextlib.suppress(OSError), (self.path / ".filler").open("ab") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()

    def free(self) -> None:
        (self.path / ".filler").unlink(missing_ok=True)

    def umount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    fs = Tmpfs(tmp_path / "small")
    try:
        yield fs
    finally:
        fs.umount()


def with_cpufreq(root: Path) -> FakeTree:
    tree = device_tree(root)
    tree.cluster(0, range(4), available=(600_000, 1_200_000, 1_800_000, 2_400_000))
    return tree


@pytest.fixture(scope="module")
def on_full_disks(tmp_path_factory: pytest.TempPathFactory, demo_ladder: Path) -> Iterator[tuple[DaemonProc, Tmpfs]]:
    """A daemon whose metrics textfile, state directory and log sit on one tmpfs that is full before it starts,
    under a stand-in for systemd's notify socket."""
    work = tmp_path_factory.mktemp("fulldisk")
    fs = Tmpfs(work / "small")
    sockets = Path(tempfile.mkdtemp(prefix="gvd", dir="/tmp"))
    notify = NotifySocket(sockets / "notify")
    (fs.path / "state").mkdir()
    (work / "d").mkdir()
    (work / "d" / "daemon.log").symlink_to(fs.path / "daemon.log")  # DaemonProc writes the daemon's output there
    (work / "d" / "state").symlink_to(fs.path / "state")
    config = f'metrics_textfile = "{fs.path}/node/governor.prom"\n' + FAULT_CONFIG  # before [restart]
    fs.fill()
    d = DaemonProc(
        work / "d",
        sockets,
        demo_ladder,
        policy=FAULT_POLICY,
        config=config,
        env={"NOTIFY_SOCKET": str(notify.path)},
        tree=with_cpufreq,
    )
    d.notify = notify  # type: ignore[attr-defined]
    try:
        d.wait_ready()
        yield d, fs
    finally:
        d.stop()
        notify.close()
        fs.umount()
        shutil.rmtree(sockets, ignore_errors=True)


def test_ready_and_ticking_with_the_metrics_textfile_on_a_full_disk(on_full_disks: tuple[DaemonProc, Tmpfs]) -> None:
    d, _fs = on_full_disks
    notify: NotifySocket = d.notify  # type: ignore[attr-defined]
    eventually(lambda: "READY" in notify.fields(), timeout_s=30)  # systemd is told, the textfile failing or not
    status = eventually(lambda: (s := d.status())["metrics_textfile"]["error"] and s, timeout_s=15)
    assert "No space left on device" in status["metrics_textfile"]["error"]
    ticks = status["ticks"]
    eventually(lambda: d.status()["ticks"] >= ticks + 3, timeout_s=10)
    assert d.status()["errors"]["loop"] == 0


def test_decisions_go_on_with_a_full_disk_under_the_log(on_full_disks: tuple[DaemonProc, Tmpfs]) -> None:
    d, _fs = on_full_disks
    d.tree.write(ZONE_TEMP, 95000)
    try:
        status = eventually(lambda: (s := d.status())["state"] == "hot" and s, timeout_s=20)
        assert status["errors"]["loop"] == 0
    finally:
        d.tree.write(ZONE_TEMP, 45000)
    eventually(lambda: d.status()["state"] != "hot", timeout_s=30)


def test_a_full_state_directory_costs_only_the_clock_cap(tmp_path: Path, tmpfs: Tmpfs) -> None:
    """The originals cannot be saved before the first cap (ENOSPC): no cap is written, and status says why."""
    tree = with_cpufreq(tmp_path / "root")
    tmpfs.fill()
    cap = FreqCap(Root(tree.root), tmpfs.path)
    cap.start()
    cap.cap(0.5)
    assert tree.path(f"{CPUFREQ}/policy0/scaling_max_freq").read_text().strip() == "2400000"
    status = cap.status()
    assert not status["writable"]
    assert "No space left on device" in status["reason"]
    cap.restore()


def test_the_textfile_is_written_again_once_there_is_room(on_full_disks: tuple[DaemonProc, Tmpfs]) -> None:
    d, fs = on_full_disks
    fs.free()
    try:
        eventually(lambda: d.status()["metrics_textfile"]["error"] is None, timeout_s=15)
        assert "governor_ticks_total" in (fs.path / "node" / "governor.prom").read_text()
        # The log (on the same tmpfs) lost the lines written while full, and goes on once there is room.
        eventually(lambda: "metrics textfile written again" in d.log(), timeout_s=10)
    finally:
        fs.fill()


def test_a_disk_filling_while_running_costs_only_the_file(on_full_disks: tuple[DaemonProc, Tmpfs]) -> None:
    d, _fs = on_full_disks  # the previous row filled it again under the running daemon
    eventually(lambda: d.status()["metrics_textfile"]["error"], timeout_s=15)
    ticks = d.status()["ticks"]
    eventually(lambda: d.status()["ticks"] > ticks + 2, timeout_s=10)
    assert not list(fs_leftovers(_fs))  # no half-written temp files left behind


def fs_leftovers(fs: Tmpfs) -> Iterator[Path]:
    node = fs.path / "node"
    return (p for p in node.iterdir() if p.name != "governor.prom") if node.exists() else iter(())


def governor(*args: str, victim: DaemonProc) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"GOVERNOR_CONTROL_SOCKET": str(victim.control)}
    return subprocess.run(
        [sys.executable, "-m", "governor", *args], check=False, capture_output=True, text=True, env=env, timeout=60
    )


def test_record_onto_a_full_disk_is_one_line(victim: DaemonProc, tmpfs: Tmpfs) -> None:
    tmpfs.fill()
    done = governor("record", str(tmpfs.path / "trace.jsonl"), "--seconds", "3", victim=victim)
    assert done.returncode == 2, done.stderr
    assert "No space left on device" in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_record_when_the_disk_fills_midway_is_one_line_with_what_was_kept(victim: DaemonProc, tmpfs: Tmpfs) -> None:
    tmpfs.fill()
    (tmpfs.path / ".filler").write_bytes(b"\0" * (256 * 1024 - 12 * 1024))  # room for a few ticks' lines
    done = governor("record", str(tmpfs.path / "trace.jsonl"), "--seconds", "20", victim=victim)
    assert done.returncode == 2, done.stderr
    assert "ticks were written" in done.stderr
    assert "Traceback" not in done.stderr


def test_reload_against_a_stopped_daemon_is_one_line(victim: DaemonProc) -> None:
    """A frozen daemon (SIGSTOP: the kernel still accepts its connections) is a one-line error, not a traceback."""
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ControlError, match="did not answer within 1 s"):
            ControlClient(victim.control, timeout_s=1.0).request("reload")
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    victim.check_alive()
