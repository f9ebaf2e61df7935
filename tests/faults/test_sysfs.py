"""Hostile sysfs trees (issue 33): the CPU frequency actuator on fake trees where the files it would write lead out
of `--root` (symlinks to a file or a directory outside), are not files (a FIFO, a directory), or hold garbage; and a
tampered state file naming paths outside. Nothing outside the root is ever written, nothing hangs or raises, and
status says the cluster is not writable."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from governor.daemon.freqcap import CPUFREQ, ORIGINALS, PSTATE, FreqCap
from sensors.root import Root
from tests.governor.daemon.daemon_proc import device_tree
from tests.sensors.tree import FakeTree

FAULT_KIND = "hostile sysfs trees"
POLICY0 = f"{CPUFREQ}/policy0"
OUTSIDE = "2400000\n"


def tree_with_cluster(root: Path) -> FakeTree:
    tree = device_tree(root)
    tree.cluster(0, range(4), available=(600_000, 1_200_000, 1_800_000, 2_400_000))
    return tree


def link_file_out(tree: FakeTree, outside: Path) -> None:
    target = tree.path(f"{POLICY0}/scaling_max_freq")
    target.unlink()
    target.symlink_to(outside / "victim")


def link_dir_out(tree: FakeTree, outside: Path) -> None:
    policy = tree.path(POLICY0)
    for name in os.listdir(policy):
        shutil.copy(policy / name, outside / name)
    shutil.rmtree(policy)
    policy.symlink_to(outside)
    (outside / "victim").unlink()
    (outside / "scaling_max_freq").rename(outside / "victim")
    (outside / "scaling_max_freq").symlink_to(outside / "victim")


def link_relative_out(tree: FakeTree, outside: Path) -> None:
    target = tree.path(f"{POLICY0}/scaling_max_freq")
    target.unlink()
    target.symlink_to(os.path.relpath(outside / "victim", target.parent))


def link_to_proc(tree: FakeTree, outside: Path) -> None:
    del outside
    target = tree.path(f"{POLICY0}/scaling_max_freq")
    target.unlink()
    target.symlink_to("/proc/self/oom_score_adj")


def fifo(tree: FakeTree, outside: Path) -> None:
    del outside
    target = tree.path(f"{POLICY0}/scaling_max_freq")
    target.unlink()
    os.mkfifo(target)


def directory(tree: FakeTree, outside: Path) -> None:
    del outside
    target = tree.path(f"{POLICY0}/scaling_max_freq")
    target.unlink()
    target.mkdir()


def pstate_out(tree: FakeTree, outside: Path) -> None:
    tree.write(f"{PSTATE}/max_perf_pct", 100)
    target = tree.path(f"{PSTATE}/max_perf_pct")
    target.unlink()
    target.symlink_to(outside / "victim")


def garbage(value: str) -> Callable[[FakeTree, Path], None]:
    def write(tree: FakeTree, outside: Path) -> None:
        del outside
        tree.write(f"{POLICY0}/cpuinfo_max_freq", value)

    return write


def available_garbage(tree: FakeTree, outside: Path) -> None:
    del outside
    tree.write(f"{POLICY0}/scaling_available_frequencies", "x " * 100_000)


def symlink_loop(tree: FakeTree, outside: Path) -> None:
    del outside
    policy = tree.path(f"{CPUFREQ}/policy1")
    policy.symlink_to(policy)


CASES: list[tuple[str, Callable[[FakeTree, Path], None]]] = [
    ("scaling_max_freq a symlink out of the root", link_file_out),
    ("policy0 a symlink out of the root", link_dir_out),
    ("scaling_max_freq a relative ../ symlink out", link_relative_out),
    ("scaling_max_freq a symlink to /proc", link_to_proc),
    ("scaling_max_freq a FIFO", fifo),
    ("scaling_max_freq a directory", directory),
    ("intel_pstate max_perf_pct a symlink out", pstate_out),
    ("cpuinfo_max_freq letters", garbage("abc")),
    ("cpuinfo_max_freq 1e400", garbage("1e400")),
    ("cpuinfo_max_freq negative", garbage("-5")),
    ("100,000 available frequencies of garbage", available_garbage),
    ("a policy directory that links to itself", symlink_loop),
]


@pytest.mark.parametrize("break_it", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_tree_is_never_written_outside_the_root(
    tmp_path: Path, break_it: Callable[[FakeTree, Path], None]
) -> None:
    tree = tree_with_cluster(tmp_path / "root")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text(OUTSIDE)
    break_it(tree, outside)
    score = Path("/proc/self/oom_score_adj").read_text()
    (tmp_path / "state").mkdir()
    cap = FreqCap(Root(tree.root), tmp_path / "state")
    cap.start()
    cap.cap(0.5)
    assert (outside / "victim").read_text() == OUTSIDE  # (the old code wrote here, and put it back at close)
    cap.cap(0.25)
    status = cap.status()
    cap.restore()
    assert (outside / "victim").read_text() == OUTSIDE
    assert Path("/proc/self/oom_score_adj").read_text() == score
    for cluster in status["clusters"]:  # whatever is left writable is inside the root, and capped there
        assert not cluster["writable"] or cluster["cap_khz"] is not None or cluster["policy"] != "policy0"


def test_a_tampered_state_file_naming_an_outside_path_is_not_written(tmp_path: Path) -> None:
    """The originals file of a crashed run names, under the root's cpufreq pattern, a file linking outside."""
    tree = tree_with_cluster(tmp_path / "root")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text(OUTSIDE)
    link_file_out(tree, outside)
    state = tmp_path / "state"
    state.mkdir()
    path = str(tree.path(f"{POLICY0}/scaling_max_freq"))
    (state / ORIGINALS).write_text(json.dumps({"files": {path: 600_000, "/etc/hostname": 1}}))
    cap = FreqCap(Root(tree.root), state)
    cap.start()  # recovery writes the "originals" back
    assert (outside / "victim").read_text() == OUTSIDE
    cap.restore()


def test_a_confined_write_still_caps_inside_the_root(tmp_path: Path) -> None:
    """The confinement refuses what leads out, not the kernel's own layout (cpuN/cpufreq -> ../cpufreq/policyN)."""
    tree = tree_with_cluster(tmp_path / "root")
    (tmp_path / "state").mkdir()
    cap = FreqCap(Root(tree.root), tmp_path / "state")
    cap.start()
    cap.cap(0.5)
    assert tree.path(f"{POLICY0}/scaling_max_freq").read_text().strip() == "1200000"
    cap.restore()
    assert tree.path(f"{POLICY0}/scaling_max_freq").read_text().strip() == "2400000"
