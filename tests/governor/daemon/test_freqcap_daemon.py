"""The frequency actuator in the real daemon process: caps written when hot, and the values found put back after
SIGTERM, after kill -9 and a restart, and kept through a bad policy reload."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from governor.daemon.control import ControlError
from tests.governor.daemon.daemon_proc import TEST_POLICY, DaemonProc, device_tree
from tests.helpers import eventually
from tests.sensors.tree import CPU, FakeTree

pytestmark = pytest.mark.slow

ZONE_TEMP = "sys/class/thermal/thermal_zone0/temp"
LITTLE = (600_000, 1_000_000, 1_400_000, 1_800_000)
BIG = (600_000, 1_200_000, 1_800_000, 2_400_000)
# Hot at once when the zone reads 95 °C (trip 80 °C), and a clock cap allowed.
POLICY = TEST_POLICY.replace("[states.hot]\nthreads = 2\n", "[states.hot]\nthreads = 4\n")


def big_little(root: Path) -> FakeTree:
    tree = device_tree(root)
    tree.cluster(0, range(2), max_khz=1_800_000, min_khz=600_000, available=LITTLE)
    tree.cluster(2, range(2, 4), max_khz=2_400_000, min_khz=600_000, available=BIG)
    return tree


def khz(tree: FakeTree) -> tuple[int, int]:
    read = [tree.path(f"{CPU}/cpufreq/policy{p}/scaling_max_freq").read_text() for p in (0, 2)]
    return int(read[0]), int(read[1])


def capped(d: DaemonProc) -> tuple[int, int]:
    def check() -> tuple[int, int]:
        little, big = khz(d.tree)
        assert big < 2_400_000, (little, big)
        assert little < 1_800_000, (little, big)
        assert little in LITTLE
        assert big in BIG
        return little, big

    return eventually(check, timeout_s=30)


def test_caps_when_hot_and_restores_after_sigterm(tmp_path: Path, sock_dir: Path, demo_ladder: Path) -> None:
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, policy=POLICY, tree=big_little)
    try:
        status = d.wait_ready()
        freq = status["actuators"]["cpufreq"]
        assert freq["writable"] is True
        assert freq["freq_cap_khz"] is None
        d.tree.write(ZONE_TEMP, 95000)
        _little, big = capped(d)
        status = eventually(lambda: d.status()["actuators"]["cpufreq"]["freq_cap_khz"] == big and d.status())
        assert status["state"] == "hot"
        assert "power budget" in status["reason"]
        assert "clock" in status["reason"]
        assert (tmp_path / "state" / "freq-originals.json").exists()
    finally:
        assert d.stop() == 0
    assert khz(d.tree) == (1_800_000, 2_400_000)
    assert not (tmp_path / "state" / "freq-originals.json").exists()


def test_kill_9_then_restart_restores_the_values_found(tmp_path: Path, sock_dir: Path, demo_ladder: Path) -> None:
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, policy=POLICY, tree=big_little)
    engine_pid = None
    try:
        d.wait_ready()
        d.tree.write(ZONE_TEMP, 95000)
        capped(d)
        engine_pid = d.status()["supervisor"]["pid"]
    finally:
        d.proc.kill()  # kill -9: no shutdown, the caps stay and so does the file
        d.proc.wait()
        if engine_pid is not None:
            os.kill(engine_pid, signal.SIGKILL)  # outside systemd the engine child outlives a SIGKILLed daemon
        d.engine.close()
    # Outside systemd (which empties RuntimeDirectory=) the sockets stay too: the next start clears them.
    assert d.control.is_socket()
    assert d.engine_socket.is_socket()
    assert khz(d.tree) != (1_800_000, 2_400_000)
    d.tree.write(ZONE_TEMP, 45000)
    again = DaemonProc(tmp_path, sock_dir, demo_ladder, policy=POLICY, tree=FakeTree)
    try:
        status = again.wait_ready()
        assert khz(again.tree) == (1_800_000, 2_400_000)
        clusters = status["actuators"]["cpufreq"]["clusters"]
        assert [c["original_khz"] for c in clusters] == [1_800_000, 2_400_000]
        assert "restored CPU frequency limits left by a previous run" in again.log()
    finally:
        assert again.stop() == 0
    assert khz(again.tree) == (1_800_000, 2_400_000)


def test_a_bad_reload_keeps_the_caps_and_their_originals(tmp_path: Path, sock_dir: Path, demo_ladder: Path) -> None:
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, policy=POLICY, tree=big_little)
    try:
        d.wait_ready()
        d.tree.write(ZONE_TEMP, 95000)
        capped(d)
        d.policy.write_text(POLICY.replace("[timing]", "[timing]\ntypo = 1"))
        with pytest.raises(ControlError, match="kept the last good policy"):
            d.client.request("reload")
        status = d.status()
        assert status["policy"]["error"]
        assert status["actuators"]["cpufreq"]["freq_cap_khz"] is not None
        assert khz(d.tree) != (1_800_000, 2_400_000)
        assert (tmp_path / "state" / "freq-originals.json").exists()
    finally:
        assert d.stop() == 0
    assert khz(d.tree) == (1_800_000, 2_400_000)


def test_status_says_when_nothing_is_writable(daemon: DaemonProc) -> None:
    freq = daemon.status()["actuators"]["cpufreq"]
    assert freq["writable"] is False
    assert "no cpufreq policies" in freq["reason"]
    assert "threads and rate are the actuators" in freq["reason"]


RAPL = "sys/class/powercap/intel-rapl:0"


def rapl_only(root: Path) -> FakeTree:
    """An Intel box whose only writable limit is the RAPL package's long-term power limit (15 W)."""
    tree = device_tree(root)
    tree.write(f"{RAPL}/name", "package-0")
    tree.write(f"{RAPL}/constraint_0_name", "long_term")
    tree.write(f"{RAPL}/constraint_0_power_limit_uw", 15_000_000)
    return tree


def uw(tree: FakeTree) -> int:
    return int(tree.path(f"{RAPL}/constraint_0_power_limit_uw").read_text())


def test_a_rapl_limit_alone_is_capped_when_hot_and_restored_after_sigterm(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path
) -> None:
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, policy=POLICY, tree=rapl_only)
    try:
        status = d.wait_ready()
        assert status["actuators"]["cpufreq"]["writable"] is True
        assert "intel-rapl:0" in status["actuators"]["cpufreq"]["reason"]
        d.tree.write(ZONE_TEMP, 95000)

        def lowered() -> int:
            limit = uw(d.tree)
            assert 3_750_000 <= limit < 15_000_000  # never under a quarter of what it found
            return limit

        eventually(lowered, timeout_s=30)

        def shown() -> dict[str, object]:
            package: dict[str, object] = d.status()["actuators"]["cpufreq"]["clusters"][-1]
            assert package["cap_khz"] is not None
            return package

        assert eventually(shown)["unit"] == "µW"
        assert (tmp_path / "state" / "freq-originals.json").exists()
    finally:
        assert d.stop() == 0
    assert uw(d.tree) == 15_000_000
    assert not (tmp_path / "state" / "freq-originals.json").exists()
