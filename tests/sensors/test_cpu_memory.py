"""cpufreq ratio and the throttled rule; meminfo and PSI."""

from __future__ import annotations

from pathlib import Path

import pytest

from sensors.cpu import parse_cpu_list
from sensors.root import Root
from sensors.sampler import SensorSampler
from sensors.snapshot import Cpu, Memory
from tests.sensors.tree import FakeTree


class FixedUtil:
    """A utilisation source that reports what the test says."""

    def __init__(self, percent: float | None) -> None:
        self.percent = percent

    def __call__(self) -> float | None:
        return self.percent


def cpu_of(tree: FakeTree, util: float | None = None) -> Cpu:
    return SensorSampler(tree.root, cpu_util=FixedUtil(util)).sample().cpu


def test_frequency_ratio_is_the_mean_over_cpus(tree: FakeTree) -> None:
    tree.cpu(0, cur_khz=1_200_000, max_khz=2_400_000)
    tree.cpu(1, cur_khz=2_400_000, max_khz=2_400_000)
    tree.write("sys/devices/system/cpu/online", "0-1")
    assert cpu_of(tree) == Cpu(freq_ratio=0.75, throttled=False, count=2, util_percent=None)


def test_a_lowered_cap_is_throttling(tree: FakeTree) -> None:
    tree.cpus(4, cur_khz=1_500_000, max_khz=1_800_000)
    tree.cpu(3, cur_khz=1_000_000, max_khz=1_800_000, scaling_max_khz=1_000_000)
    cpu = cpu_of(tree)
    assert cpu.throttled is True
    assert cpu.freq_ratio == pytest.approx((1.5 * 3 + 1.0) / (1.8 * 4))


@pytest.mark.parametrize(("util", "throttled"), [(95.0, True), (50.0, False), (None, False)])
def test_a_slow_clock_under_load_is_throttling(tree: FakeTree, util: float | None, throttled: bool) -> None:
    tree.cpus(4, cur_khz=600_000, max_khz=1_800_000)  # a Pi's firmware lowers the clock, not the cap
    cpu = cpu_of(tree, util)
    assert cpu.throttled is throttled
    assert cpu.util_percent == util


def test_offline_cpus_are_left_out(tree: FakeTree) -> None:
    tree.cpus(4, cur_khz=1_000_000, max_khz=2_000_000)
    tree.cpu(2, cur_khz=2_000_000, max_khz=2_000_000, scaling_max_khz=1_000_000)
    tree.write("sys/devices/system/cpu/online", "0-1,3")
    cpu = cpu_of(tree)
    assert (cpu.count, cpu.freq_ratio, cpu.throttled) == (3, 0.5, False)


class CountingRoot(Root):
    def __init__(self, prefix: Path) -> None:
        super().__init__(prefix)
        self.reads: list[str] = []

    def read(self, path: str) -> bytes:
        self.reads.append(self.display(path))
        return super().read(path)


def test_cpus_sharing_a_clock_are_read_once_per_policy_and_weighted_by_online_cpus(tree: FakeTree) -> None:
    # An 8-core big.LITTLE phone: cpu0-3 share policy0, cpu4-7 policy4 (cpuN/cpufreq links there, as on the kernel).
    tree.cluster(0, range(4), max_khz=1_800_000)
    tree.cluster(4, range(4, 8), max_khz=2_400_000, scaling_max_khz=1_200_000)
    tree.write("sys/devices/system/cpu/cpufreq/policy0/scaling_cur_freq", 1_800_000)
    tree.write("sys/devices/system/cpu/cpufreq/policy4/scaling_cur_freq", 1_200_000)
    tree.write("sys/devices/system/cpu/online", "0-2,4-7")  # cpu3 unplugged
    root = CountingRoot(tree.root)
    sampler = SensorSampler(root, cpu_util=None)
    sampler.inventory()
    root.reads.clear()
    cpu = sampler.sample().cpu
    assert (cpu.count, cpu.throttled) == (7, True)
    assert cpu.freq_ratio == pytest.approx((3 * 1.0 + 4 * 0.5) / 7)  # the mean over the online CPUs
    freq_reads = [p for p in root.reads if "cpufreq" in p]
    assert len(freq_reads) == 4  # cur and cap of each policy, not of each CPU
    assert "cpufreq for 8 CPUs (2 policies)" in sampler.notes()


def test_no_cpufreq_means_unknown_not_zero(tree: FakeTree) -> None:
    tree.write("sys/devices/system/cpu/online", "0-1")
    tree.write("sys/devices/system/cpu/cpu0/topology/core_id", 0)
    assert cpu_of(tree) == Cpu(freq_ratio=None, throttled=None, count=2, util_percent=None)


def test_cpu_list_format() -> None:
    assert parse_cpu_list("0-3,5,7-8") == {0, 1, 2, 3, 5, 7, 8}
    assert parse_cpu_list("0") == {0}


def test_meminfo_and_pressure(tree: FakeTree) -> None:
    tree.meminfo(total_kb=3_884_000, available_kb=2_100_000, swap_total_kb=102_396, swap_free_kb=51_200)
    tree.psi(some=12.5, full=3.25)
    assert SensorSampler(tree.root, cpu_util=None).sample().memory == Memory(
        total_bytes=3_884_000 * 1024,
        available_bytes=2_100_000 * 1024,
        swap_total_bytes=102_396 * 1024,
        swap_free_bytes=51_200 * 1024,
        psi_some_avg10=12.5,
        psi_full_avg10=3.25,
        lmkd=False,
    )


def test_kernel_without_psi_is_normal(tree: FakeTree) -> None:
    tree.meminfo()
    sampler = SensorSampler(tree.root, cpu_util=None)
    snapshot = sampler.sample()
    assert (snapshot.memory.psi_some_avg10, snapshot.memory.psi_full_avg10) == (None, None)
    assert snapshot.problems == ()
    assert any("pressure/memory is absent" in note for note in sampler.notes())


def test_meminfo_without_memavailable_is_a_problem(tree: FakeTree) -> None:
    tree.write("proc/meminfo", "MemTotal:        1000 kB\nMemFree:          500 kB\n", newline=False)
    snapshot = SensorSampler(tree.root, cpu_util=None).sample()
    assert (snapshot.memory.total_bytes, snapshot.memory.available_bytes) == (1_024_000, None)
    assert [(p.path, p.reason) for p in snapshot.problems] == [("/proc/meminfo", "no MemAvailable line")]


def test_a_cpu_without_scaling_max_freq_needs_no_rediscovery(tree: FakeTree) -> None:
    tree.cpus(2, cur_khz=900_000, max_khz=1_800_000)
    tree.path("sys/devices/system/cpu/cpu1/cpufreq/scaling_max_freq").unlink()
    sampler = SensorSampler(tree.root, cpu_util=None)
    first = sampler.sample()
    inventory = sampler.inventory()
    second = sampler.sample()
    assert sampler.inventory() is inventory  # an absent optional file is not a vanished one
    assert first.problems == second.problems == ()
    assert (second.cpu.freq_ratio, second.cpu.throttled) == (0.5, False)


def test_a_fast_tick_reads_memory_and_load_at_most_every_slow_max_age_s_and_temperature_every_time(
    tree: FakeTree,
) -> None:
    tree.thermal_zone(0, "cpu-thermal", 50_000)
    tree.meminfo(available_kb=3_000_000)
    tree.psi(some=1.0)
    tree.cpu_psi(some=2.0)
    tree.proc_stat(busy=0, idle=100)
    now = [100.0]
    sampler = SensorSampler(tree.root, cpu_util=None, slow_max_age_s=1.0, monotonic=lambda: now[0])

    def sample() -> tuple[float | None, int | None, float | None, float | None]:
        snapshot = sampler.sample()
        memory = snapshot.memory
        temp = snapshot.temperatures[0].temp_c
        return temp, memory.available_bytes, memory.psi_some_avg10, snapshot.cpu.psi_some_avg10

    assert sample() == (50.0, 3_000_000 * 1024, 1.0, 2.0)
    tree.write("sys/class/thermal/thermal_zone0/temp", 51_000)
    tree.meminfo(available_kb=2_000_000)
    tree.psi(some=20.0)
    tree.cpu_psi(some=30.0)
    tree.proc_stat(busy=100, idle=200)
    now[0] += 0.75
    assert sample() == (51.0, 3_000_000 * 1024, 1.0, 2.0)  # the thermal reading is new, memory and load the last
    now[0] += 0.25
    assert sample() == (51.0, 2_000_000 * 1024, 20.0, 30.0)  # a second after the read: read again
    assert sampler.sample().cpu.util_percent == 50.0  # over the second between the two reads of proc/stat
    tree.meminfo(available_kb=1_000_000)
    sampler.invalidate()  # a rediscovery reads everything at once
    assert sample()[1] == 1_000_000 * 1024


def test_a_memory_problem_stays_reported_while_the_reading_is_reused(tree: FakeTree) -> None:
    tree.write("proc/meminfo", "MemTotal: 1000 kB\n")
    now = [100.0]
    sampler = SensorSampler(tree.root, cpu_util=None, slow_max_age_s=1.0, monotonic=lambda: now[0])
    first = [p.reason for p in sampler.sample().problems]
    now[0] += 0.25
    assert [p.reason for p in sampler.sample().problems] == first
    assert "no MemAvailable line" in first


def test_clusters_come_from_cpu_capacity_fastest_first_online_only(tree: FakeTree) -> None:
    """A 2 big + 6 little phone (Helio G99-like): the scheduler's cpu_capacity per core, the big cluster first; an
    unplugged core leaves its cluster."""
    tree.cluster(0, range(6), max_khz=2_000_000, capacity=446)
    tree.cluster(6, range(6, 8), max_khz=2_200_000, capacity=1024)
    tree.write("sys/devices/system/cpu/online", "0-4,6-7")
    clusters = cpu_of(tree).clusters
    assert [(c.cpus, c.capacity) for c in clusters] == [((6, 7), 1.0), ((0, 1, 2, 3, 4), round(446 / 1024, 3))]


def test_without_cpu_capacity_the_clusters_come_from_the_top_clock(tree: FakeTree) -> None:
    """An x86 hybrid (2 P cores at 4.4 GHz, 8 E cores at 3.3 GHz): no cpu_capacity, the clock tells them apart."""
    tree.cluster(0, range(2), max_khz=4_400_000)
    tree.cluster(2, range(2, 10), max_khz=3_300_000)
    clusters = cpu_of(tree).clusters
    assert [(c.cpus, c.capacity) for c in clusters] == [((0, 1), 1.0), (tuple(range(2, 10)), 0.75)]


def test_alike_cores_are_no_clusters(tree: FakeTree) -> None:
    tree.cluster(0, range(2), max_khz=2_400_000, capacity=1024)
    tree.cluster(2, range(2, 4), max_khz=2_400_000, capacity=1024)
    assert cpu_of(tree).clusters == ()


def test_android_lmkd_is_found_under_the_root(tree: FakeTree) -> None:
    """Android's low memory killer (system/bin/lmkd) kills on pressure: the policy counts the mapped weights."""
    tree.meminfo()
    assert SensorSampler(tree.root, cpu_util=None).sample().memory.lmkd is False
    tree.write("system/bin/lmkd", "")
    assert SensorSampler(tree.root, cpu_util=None).sample().memory.lmkd is True
