"""The CPU frequency actuator on fake sysfs trees: per-cluster caps the kernel accepts; originals saved, restored."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from governor.daemon.freqcap import ORIGINALS, FreqCap
from sensors.root import Root
from sensors.sampler import SensorSampler
from tests.sensors.tree import CPU, FakeTree

LITTLE = (408_000, 600_000, 816_000, 1_008_000, 1_200_000, 1_416_000, 1_608_000, 1_800_000)
BIG = (408_000, 816_000, 1_200_000, 1_608_000, 2_016_000, 2_208_000, 2_400_000)


def big_little(root: Path) -> FakeTree:
    """An RK3588-like board: four LITTLE cores to 1.8 GHz, four big cores to 2.4 GHz, each with its frequency table."""
    tree = FakeTree(root)
    tree.cluster(0, range(4), max_khz=1_800_000, min_khz=408_000, available=LITTLE)
    tree.cluster(4, range(4, 8), max_khz=2_400_000, min_khz=408_000, available=BIG)
    tree.write(f"{CPU}/online", "0-7")
    return tree


def read_khz(tree: FakeTree, policy: int) -> int:
    return int(tree.path(f"{CPU}/cpufreq/policy{policy}/scaling_max_freq").read_text())


def test_caps_each_cluster_at_a_frequency_of_its_own_table(tmp_path: Path) -> None:
    tree = big_little(tmp_path / "root")
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    cap.cap(0.6)  # 1.08 GHz LITTLE, 1.44 GHz big: the highest table entries under those
    assert (read_khz(tree, 0), read_khz(tree, 4)) == (1_008_000, 1_200_000)
    status = cap.status()
    assert status["writable"] is True
    assert status["freq_cap_khz"] == 1_200_000
    assert [c["cap_khz"] for c in status["clusters"]] == [1_008_000, 1_200_000]


def test_never_below_cpuinfo_min_freq_and_never_above_what_it_found(tmp_path: Path) -> None:
    tree = FakeTree(tmp_path / "root")
    tree.cluster(0, range(4), max_khz=2_400_000, min_khz=600_000, scaling_max_khz=1_500_000)  # a user's own limit
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    cap.cap(0.05)
    assert read_khz(tree, 0) == 600_000  # no table: clamped to cpuinfo_min_freq
    cap.cap(0.9)  # 2.16 GHz is above the user's 1.5 GHz: the user's limit stays
    assert read_khz(tree, 0) == 1_500_000
    cap.cap(None)
    assert read_khz(tree, 0) == 1_500_000


def test_originals_are_saved_before_the_first_write_and_restored_on_close(tmp_path: Path) -> None:
    tree = big_little(tmp_path / "root")
    saved = tmp_path / ORIGINALS
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    assert not saved.exists()  # nothing written yet, nothing to save
    cap.cap(0.5)
    files = json.loads(saved.read_text())["files"]
    assert sorted(files.values()) == [1_800_000, 2_400_000]
    cap.restore()
    assert (read_khz(tree, 0), read_khz(tree, 4)) == (1_800_000, 2_400_000)
    assert not saved.exists()


def test_a_crashed_runs_caps_are_restored_at_the_next_start(tmp_path: Path) -> None:
    tree = big_little(tmp_path / "root")
    crashed = FreqCap(Root(tree.root), tmp_path)
    crashed.start()
    crashed.cap(0.4)  # then kill -9: no close()
    assert read_khz(tree, 4) < 2_400_000
    after = FreqCap(Root(tree.root), tmp_path)
    after.start()
    assert (read_khz(tree, 0), read_khz(tree, 4)) == (1_800_000, 2_400_000)
    assert [c.original_khz for c in after.clusters] == [1_800_000, 2_400_000]  # not the crashed run's caps
    assert not (tmp_path / ORIGINALS).exists()


def test_lifting_the_cap_writes_the_original_back(tmp_path: Path) -> None:
    tree = big_little(tmp_path / "root")
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    cap.cap(0.5)
    cap.cap(1.0)
    assert (read_khz(tree, 0), read_khz(tree, 4)) == (1_800_000, 2_400_000)
    assert cap.status()["freq_cap_khz"] is None


def test_ratios_are_the_fastest_clusters_table(tmp_path: Path) -> None:
    cap = FreqCap(Root(big_little(tmp_path / "root").root), tmp_path)
    cap.start()
    assert cap.ratios() == tuple(sorted(round(f / 2_400_000, 4) for f in BIG))


class ReadOnlySys(Root):
    """/sys mounted read-only (a user unit, ProtectKernelTunables=, Termux without root)."""

    def writable(self, path: str) -> bool:
        return False


def test_nothing_writable_says_so_and_offers_no_ratios(tmp_path: Path) -> None:
    tree = big_little(tmp_path / "root")
    cap = FreqCap(ReadOnlySys(tree.root), tmp_path)
    cap.start()
    assert cap.ratios() is None
    cap.cap(0.5)
    assert read_khz(tree, 4) == 2_400_000
    status = cap.status()
    assert status["writable"] is False
    assert "not writable" in status["reason"]
    assert "threads and rate are the actuators" in status["reason"]


def test_no_cpufreq_at_all_says_so(tmp_path: Path) -> None:
    cap = FreqCap(Root(tmp_path / "empty"), tmp_path)
    cap.start()
    assert cap.ratios() is None
    assert "no cpufreq policies" in cap.status()["reason"]


class RefusingWrites(Root):
    def write(self, path: str, data: bytes) -> None:
        raise OSError(errno.EROFS, "Read-only file system")


def test_a_refused_write_marks_the_cluster_unwritable(tmp_path: Path) -> None:
    tree = big_little(tmp_path / "root")
    cap = FreqCap(RefusingWrites(tree.root), tmp_path)
    cap.start()
    cap.cap(0.5)
    status = cap.status()
    assert status["writable"] is False
    assert "failed" in status["reason"]


@pytest.mark.parametrize("content", ["{not json", '{"files": {"x": "abc"}}', "[]"])
def test_a_damaged_saved_file_is_reported_and_left(tmp_path: Path, content: str) -> None:
    tree = big_little(tmp_path / "root")
    (tmp_path / ORIGINALS).write_text(content)
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()  # no crash, nothing written
    assert read_khz(tree, 4) == 2_400_000
    assert (tmp_path / ORIGINALS).read_text() == content


def test_a_saved_file_naming_another_file_writes_nothing(tmp_path: Path) -> None:
    """Run as root with a state directory others can write (bench-device once defaulted to /tmp): a planted file
    must not make the daemon write a number into any file but the CPU limits it writes itself."""
    tree = big_little(tmp_path / "root")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    policy = tree.path(f"{CPU}/cpufreq/policy4/scaling_max_freq")
    for target in (victim, Path(f"{policy.parent}/../../../../../../../../{victim}")):
        saved = {"files": {str(policy): 1_200_000, str(target): 1}}
        (tmp_path / ORIGINALS).write_text(json.dumps(saved))
        FreqCap(Root(tree.root), tmp_path).start()
        assert victim.read_text() == "keep me"
        assert read_khz(tree, 4) == 2_400_000  # the file is refused whole
        assert (tmp_path / ORIGINALS).exists()  # and left for a person to look at


@pytest.mark.parametrize("planted", ["others may write it", "a symlink"])
def test_a_saved_file_that_is_not_our_own_is_not_trusted(tmp_path: Path, planted: str) -> None:
    tree = big_little(tmp_path / "root")
    policy = tree.path(f"{CPU}/cpufreq/policy4/scaling_max_freq")
    content = json.dumps({"files": {str(policy): 1_200_000}})
    if planted == "a symlink":
        (tmp_path / "elsewhere.json").write_text(content)
        (tmp_path / ORIGINALS).symlink_to(tmp_path / "elsewhere.json")
    else:
        (tmp_path / ORIGINALS).write_text(content)
        (tmp_path / ORIGINALS).chmod(0o666)
    FreqCap(Root(tree.root), tmp_path).start()
    assert read_khz(tree, 4) == 2_400_000


def test_saving_replaces_a_planted_link_and_never_writes_through_it(tmp_path: Path) -> None:
    tree = big_little(tmp_path / "root")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / ORIGINALS).symlink_to(victim)
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    cap.cap(0.5)
    assert victim.read_text() == "keep me"
    assert not (tmp_path / ORIGINALS).is_symlink()
    assert json.loads((tmp_path / ORIGINALS).read_text())["files"]
    cap.restore()
    assert read_khz(tree, 4) == 2_400_000


PSTATE = f"{CPU}/intel_pstate"


def intel(root: Path, *, cpufreq: bool = True) -> FakeTree:
    """An Intel laptop under intel_pstate: one policy per core without a frequency table, and the driver's
    package-wide max_perf_pct (the user's floor in min_perf_pct)."""
    tree = FakeTree(root)
    if cpufreq:
        for cpu in range(4):
            tree.cluster(cpu, range(cpu, cpu + 1), max_khz=3_400_000, min_khz=400_000)
    tree.write(f"{PSTATE}/max_perf_pct", 100)
    tree.write(f"{PSTATE}/min_perf_pct", 20)
    return tree


def pct(tree: FakeTree) -> int:
    return int(tree.path(f"{PSTATE}/max_perf_pct").read_text())


def test_intel_pstate_max_perf_pct_is_capped_with_the_policies_and_restored(tmp_path: Path) -> None:
    tree = intel(tmp_path / "root")
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    assert "intel_pstate" in cap.reason
    cap.cap(0.6)
    assert pct(tree) == 60
    assert read_khz(tree, 0) == 2_040_000
    status = cap.status()
    assert status["freq_cap_khz"] == 2_040_000  # kHz only: the percentage is its own entry
    assert status["clusters"][-1] == {
        "policy": "intel_pstate", "cpus": "all", "writable": True, "cap_khz": 60, "original_khz": 100,
        "min_khz": 20, "max_khz": 100, "unit": "%",
    }  # fmt: skip
    cap.cap(0.05)
    assert pct(tree) == 20  # never below the driver's min_perf_pct
    cap.restore()
    assert pct(tree) == 100
    assert not (tmp_path / ORIGINALS).exists()


def test_intel_pstate_alone_is_an_actuator_and_a_crash_is_undone_at_the_next_start(tmp_path: Path) -> None:
    tree = intel(tmp_path / "root", cpufreq=False)
    crashed = FreqCap(Root(tree.root), tmp_path)
    crashed.start()
    ratios = crashed.ratios()
    assert ratios is not None
    assert ratios[0] == 0.2
    assert ratios[-1] == 1.0
    crashed.cap(0.5)
    assert pct(tree) == 50
    after = FreqCap(Root(tree.root), tmp_path)  # kill -9: no close(); the next start restores from the saved file
    after.start()
    assert pct(tree) == 100


def test_without_intel_pstate_nothing_is_reported(tmp_path: Path) -> None:
    tree = big_little(tmp_path / "root")
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    assert [c["policy"] for c in cap.status()["clusters"]] == ["policy0", "policy4"]
    assert "intel_pstate" not in cap.reason


POWERCAP = "sys/class/powercap"


def rapl(root: Path, *, limit_uw: int = 15_000_000, cpufreq: bool = False, enabled: int = 1) -> FakeTree:
    """An Intel laptop's RAPL zones: package-0 with its long-term (PL1) and short-term (PL2) limits, a core subzone,
    and a psys zone (a platform limit, not the package's)."""
    tree = intel(root, cpufreq=cpufreq) if cpufreq else FakeTree(root)
    package = f"{POWERCAP}/intel-rapl:0"
    tree.write(f"{package}/name", "package-0")
    tree.write(f"{package}/enabled", enabled)
    tree.write(f"{package}/constraint_0_name", "long_term")
    tree.write(f"{package}/constraint_0_power_limit_uw", limit_uw)
    tree.write(f"{package}/constraint_0_max_power_uw", 28_000_000)
    tree.write(f"{package}/constraint_1_name", "short_term")
    tree.write(f"{package}/constraint_1_power_limit_uw", 25_000_000)
    tree.write(f"{POWERCAP}/intel-rapl:0:0/name", "core")
    tree.write(f"{POWERCAP}/intel-rapl:0:0/constraint_0_name", "long_term")
    tree.write(f"{POWERCAP}/intel-rapl:0:0/constraint_0_power_limit_uw", 0)
    return tree


def uw(tree: FakeTree, constraint: int = 0, zone: str = "intel-rapl:0") -> int:
    return int(tree.path(f"{POWERCAP}/{zone}/constraint_{constraint}_power_limit_uw").read_text())


def test_the_rapl_package_long_term_limit_is_capped_with_the_clock_and_restored(tmp_path: Path) -> None:
    tree = rapl(tmp_path / "root", cpufreq=True)
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    assert "intel-rapl:0" in cap.reason
    cap.cap(0.6)
    assert uw(tree) == 9_000_000  # 60 % of the 15 W found
    assert uw(tree, 1) == 25_000_000  # the short-term limit is the firmware's business
    assert uw(tree, 0, "intel-rapl:0:0") == 0  # subzones untouched
    assert pct(tree) == 60
    assert read_khz(tree, 0) == 2_040_000
    status = cap.status()
    assert status["freq_cap_khz"] == 2_040_000  # a clock, not watts
    assert status["clusters"][-1] == {
        "policy": "intel-rapl:0", "cpus": "package-0", "writable": True, "cap_khz": 9_000_000,
        "original_khz": 15_000_000, "min_khz": 3_750_000, "max_khz": 15_000_000, "unit": "µW",
    }  # fmt: skip
    cap.cap(0.05)
    assert uw(tree) == 3_750_000  # never below a quarter of the limit found
    cap.restore()
    assert uw(tree) == 15_000_000
    assert not (tmp_path / ORIGINALS).exists()


def test_rapl_alone_is_an_actuator_and_a_crash_is_undone_at_the_next_start(tmp_path: Path) -> None:
    tree = rapl(tmp_path / "root")
    crashed = FreqCap(Root(tree.root), tmp_path)
    crashed.start()
    ratios = crashed.ratios()
    assert ratios is not None
    assert ratios[0] == 0.25
    assert ratios[-1] == 1.0
    crashed.cap(0.5)
    assert uw(tree) == 7_500_000
    saved = json.loads((tmp_path / ORIGINALS).read_text())
    assert saved["files"] == {str(tree.path(f"{POWERCAP}/intel-rapl:0/constraint_0_power_limit_uw")): 15_000_000}
    after = FreqCap(Root(tree.root), tmp_path)  # kill -9: no close(); the next start restores from the saved file
    after.start()
    assert uw(tree) == 15_000_000
    assert not (tmp_path / ORIGINALS).exists()


def test_a_disabled_rapl_zone_is_left_alone_and_an_unwritable_one_says_so(tmp_path: Path) -> None:
    tree = rapl(tmp_path / "off", enabled=0)  # the firmware does not enforce the limit: writing it would do nothing
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    assert cap.ratios() is None
    assert cap.status()["clusters"] == []
    tree = rapl(tmp_path / "ro")
    cap = FreqCap(ReadOnlySys(tree.root), tmp_path)
    cap.start()
    assert cap.ratios() is None
    cap.cap(0.5)
    assert uw(tree) == 15_000_000
    reason = cap.status()["reason"]
    assert "/sys/class/powercap/intel-rapl:0/constraint_0_power_limit_uw not writable" in reason
    assert "threads and rate are the actuators" in reason


def test_the_daemons_own_cap_is_not_throttling_but_a_kernel_step_under_it_is(tmp_path: Path) -> None:
    """The sensors tell the kernel's throttling from the cap the daemon wrote: the policy's setpoint moves away from
    the trip only for the kernel's (`[power] throttled_margin_c`); with its own cap taken for throttling, the daemon
    held the die 3 °C cooler than the policy (and the lab) asked, for fewer tokens."""
    tree = big_little(tmp_path / "root")
    cap = FreqCap(Root(tree.root), tmp_path)
    cap.start()
    sampler = SensorSampler(tree.root, cpu_util=lambda: 95.0, own_caps=cap.own_caps)
    assert sampler.sample().cpu.throttled is False
    cap.cap(0.6)  # 1.008 GHz LITTLE, 1.2 GHz big
    for policy, khz in ((0, 1_008_000), (4, 1_200_000)):
        tree.write(f"{CPU}/cpufreq/policy{policy}/scaling_cur_freq", khz)  # loaded, at the cap
    assert sampler.sample().cpu.throttled is False
    tree.write(f"{CPU}/cpufreq/policy4/scaling_max_freq", 816_000)  # a cooling device's request under ours
    assert sampler.sample().cpu.throttled is True
    tree.write(f"{CPU}/cpufreq/policy4/scaling_max_freq", 1_200_000)
    for policy in (0, 4):  # firmware: the clock, not the cap (under 60 % of ours, on average over the CPUs)
        tree.write(f"{CPU}/cpufreq/policy{policy}/scaling_cur_freq", 600_000)
    assert sampler.sample().cpu.throttled is True
    cap.restore()  # back to the originals: a cap found under cpuinfo_max_freq is someone else's again
    tree.write(f"{CPU}/cpufreq/policy4/scaling_cur_freq", 2_400_000)
    tree.write(f"{CPU}/cpufreq/policy0/scaling_cur_freq", 1_800_000)
    assert sampler.sample().cpu.throttled is False
    tree.write(f"{CPU}/cpufreq/policy0/scaling_max_freq", 1_008_000)
    assert sampler.sample().cpu.throttled is True
