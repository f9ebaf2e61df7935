"""The sampler keeps its per-tick files open between samples (pread at offset 0): never a stale reading."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from sensors.sampler import SensorSampler
from tests.sensors.tree import FakeTree

ZONE = "sys/class/thermal/thermal_zone0/temp"


def open_under(root: Path) -> list[str]:
    """Files under `root` this process has open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith(str(root.resolve())):
            out.append(target)
    return out


def zone_temp(sampler: SensorSampler) -> float | None:
    return sampler.sample().temperatures[0].temp_c


def test_a_held_file_is_read_again_for_each_sample(tree: FakeTree) -> None:
    tree.laptop()
    sampler = SensorSampler(tree.root, cpu_util=None)
    sampler.sample()
    held = open_under(tree.root)
    assert str(tree.path(ZONE).resolve()) in held  # kept open, not opened again next time
    tree.write(ZONE, 61500)
    assert zone_temp(sampler) == 61.5
    tree.write(ZONE, 45000)
    assert zone_temp(sampler) == 45.0
    for _ in range(5):
        sampler.sample()
    assert sorted(open_under(tree.root)) == sorted(held)  # one descriptor per file, however many samples
    again, fresh = sampler.sample(), SensorSampler(tree.root, cpu_util=None).sample()  # held reads vs opened
    assert (again.temperatures, again.battery, again.memory) == (fresh.temperatures, fresh.battery, fresh.memory)
    sampler.close()
    assert open_under(tree.root) == []


def test_a_deleted_file_is_vanished_not_its_last_value(tree: FakeTree) -> None:
    tree.thermal_zone(0, "cpu-thermal", 50000, trips=())
    tree.thermal_zone(1, "gpu-thermal", 40000, trips=())
    sampler = SensorSampler(tree.root, cpu_util=None)
    assert zone_temp(sampler) == 50.0
    tree.path(ZONE).unlink()  # the descriptor would still read 50000
    snapshot = sampler.sample()
    assert snapshot.temperatures[0].temp_c is None
    assert [p.path for p in snapshot.problems] == [f"/{ZONE}"]
    sampler.close()


def test_a_file_replaced_by_another_reads_the_new_one(tree: FakeTree) -> None:
    tree.thermal_zone(0, "cpu-thermal", 50000, trips=())
    sampler = SensorSampler(tree.root, cpu_util=None)
    assert zone_temp(sampler) == 50.0
    new = tree.path("sys/new-temp")
    new.write_text("70000\n")
    os.replace(new, tree.path(ZONE))  # an atomic rewrite: a new file at the path, the held one deleted
    assert zone_temp(sampler) == 70.0
    sampler.close()


def test_a_sampler_that_is_dropped_closes_its_files(tree: FakeTree) -> None:
    tree.laptop()
    SensorSampler(tree.root, cpu_util=None).sample()
    gc.collect()
    assert open_under(tree.root) == []
