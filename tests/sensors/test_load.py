"""CPU contention readings from fake proc/stat, proc/PID/stat and proc/pressure/cpu files."""

from __future__ import annotations

import os

import pytest

from sensors.sampler import SensorSampler
from sensors.snapshot import Cpu
from tests.sensors.tree import FakeTree

ENGINE = 4242


class Pid:
    """The daemon's view of its engine child: a pid or none."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid

    def __call__(self) -> int | None:
        return self.pid


def test_other_processes_cpu_excludes_the_engine(tree: FakeTree) -> None:
    tree.cpus(2)
    tree.cpu_psi(66.5)
    tree.proc_stat(busy=1000, idle=1000, running=4)
    tree.process(ENGINE, utime=400, stime=100)
    sampler = SensorSampler(tree.root, engine_pid=Pid(ENGINE))
    first = sampler.sample().cpu
    assert (first.other_cores, first.engine_cores, first.util_percent) == (None, None, None)  # no interval yet
    assert (first.run_queue, first.psi_some_avg10, first.psi_full_avg10) == (4, 66.5, 0.0)
    # 1 s on 2 CPUs = 200 ticks: 180 busy, of which the engine's threads took 90 -> the others used 0.9 cores.
    tree.proc_stat(busy=1180, idle=1020, running=3)
    tree.process(ENGINE, utime=470, stime=120)
    cpu = sampler.sample().cpu
    assert cpu.other_cores == pytest.approx(0.9)
    assert cpu.engine_cores == pytest.approx(0.9)
    assert cpu.util_percent == pytest.approx(90.0)
    assert cpu.run_queue == 3


def test_without_an_engine_every_busy_tick_is_someone_else(tree: FakeTree) -> None:
    tree.proc_stat(busy=0, idle=0)
    sampler = SensorSampler(tree.root)
    sampler.sample()
    tree.proc_stat(busy=100, idle=100)
    cpu = sampler.sample().cpu
    assert cpu.other_cores == pytest.approx(1.0)
    assert cpu.engine_cores is None


def test_a_restarted_engine_leaves_one_interval_unknown_then_counts_again(tree: FakeTree) -> None:
    pid = Pid(ENGINE)
    tree.proc_stat(busy=0, idle=0)
    tree.process(ENGINE, utime=0)
    sampler = SensorSampler(tree.root, engine_pid=pid)
    sampler.sample()
    tree.proc_stat(busy=100, idle=100)
    tree.process(ENGINE, utime=100)
    assert sampler.sample().cpu.other_cores == pytest.approx(0.0)
    pid.pid = ENGINE + 1  # a new engine process: its counters have nothing to do with the old one's
    tree.process(ENGINE + 1, utime=5)
    tree.proc_stat(busy=300, idle=100)
    assert sampler.sample().cpu.other_cores is None  # which share of this interval was the new engine's: unknown
    tree.proc_stat(busy=500, idle=100)
    tree.process(ENGINE + 1, utime=105)
    assert sampler.sample().cpu.other_cores == pytest.approx(1.0)


def test_a_short_interval_keeps_the_previous_figure(tree: FakeTree) -> None:
    tree.proc_stat(busy=0, idle=0)
    sampler = SensorSampler(tree.root)
    sampler.sample()
    tree.proc_stat(busy=100, idle=100)
    assert sampler.sample().cpu.other_cores == pytest.approx(1.0)
    tree.proc_stat(busy=110, idle=100)  # 10 ticks on 2 CPUs: 0.05 s, noise
    assert sampler.sample().cpu.other_cores == pytest.approx(1.0)
    tree.proc_stat(busy=110, idle=300)  # measured from the last used counters: 10 busy of 210
    assert sampler.sample().cpu.other_cores == pytest.approx(2 * 10 / 210, abs=1e-3)


def test_missing_files_are_unknown_and_named_in_the_notes(tree: FakeTree) -> None:
    tree.cpus(2)
    sampler = SensorSampler(tree.root, engine_pid=Pid(ENGINE))
    sampler.sample()
    cpu = sampler.sample().cpu
    assert cpu == Cpu(freq_ratio=cpu.freq_ratio, throttled=False, count=2)
    notes = sampler.notes()
    assert any("no CPU load figures" in n and "proc/stat" in n for n in notes)
    assert any("no CPU pressure" in n for n in notes)


def test_an_engine_missing_from_the_tree_is_not_a_problem(tree: FakeTree) -> None:
    tree.proc_stat(busy=0, idle=0)
    sampler = SensorSampler(tree.root, engine_pid=Pid(ENGINE))
    sampler.sample()
    tree.proc_stat(busy=100, idle=100)
    snapshot = sampler.sample()
    assert snapshot.cpu.other_cores is None  # the engine's share is unknown, so the others' is too
    assert snapshot.problems == ()


@pytest.mark.parametrize(
    ("stat", "reason"),
    [
        ("cpu  1 2 x 4\ncpu0 1 2 3 4\n", "not a cpu line"),
        ("intr 1\nprocs_running 2\n", "no cpu lines"),
    ],
)
def test_a_garbled_proc_stat_is_a_problem(tree: FakeTree, stat: str, reason: str) -> None:
    tree.write("proc/stat", stat, newline=False)
    snapshot = SensorSampler(tree.root).sample()
    assert snapshot.cpu.run_queue is None
    reasons = [p.reason for p in snapshot.problems if p.path == "/proc/stat"]
    assert len(reasons) == 1
    assert reasons[0].startswith(reason)


def test_a_garbled_process_stat_is_a_problem(tree: FakeTree) -> None:
    tree.proc_stat(busy=0, idle=0)
    tree.write(f"proc/{ENGINE}/stat", "4242 (x) S 1", newline=False)
    snapshot = SensorSampler(tree.root, engine_pid=Pid(ENGINE)).sample()
    assert [p.path for p in snapshot.problems] == [f"/proc/{ENGINE}/stat"]


def test_the_live_machine_reads() -> None:
    """On this machine: the files exist and the "engine" (this process, burning CPU) is told apart from the rest."""
    sampler = SensorSampler("/", engine_pid=os.getpid)
    sampler.sample()
    for _ in range(500):
        cpu = sampler.sample().cpu
        if cpu.engine_cores is not None:
            break
        sum(range(200_000))
    assert cpu.engine_cores is not None
    assert cpu.engine_cores > 0
    assert cpu.other_cores is not None
    assert cpu.other_cores >= 0
    assert cpu.run_queue is not None
    assert cpu.run_queue >= 1
