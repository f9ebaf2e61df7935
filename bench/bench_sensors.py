"""One full sensor sample on a tree of 16 thermal zones, 8 hwmon chips (2 inputs each), 2 power supplies and 8 CPUs.

Goal: under 2 ms median per sample. Also measured in the same run, for comparison: discovery (done once and every
30 s), how much of a sample is pydantic (the same snapshot validated from a dict), writing a trace line
(model_dump_json) and reading one back (model_validate_json, what the lab's replay does).
Usage: .venv/bin/python bench/bench_sensors.py [--samples N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the fake-tree builder lives in tests/

from sensors.root import Reader
from sensors.sampler import SensorSampler
from sensors.snapshot import Snapshot
from tests.sensors.tree import FakeTree

GOAL_MS = 2.0


def timed(func: Callable[[], object], n: int) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        start = time.perf_counter_ns()
        func()
        out.append((time.perf_counter_ns() - start) / 1e6)
    return out


def report(name: str, ms: list[float], *, goal: bool = False) -> None:
    ms = sorted(ms)
    median, p95 = statistics.median(ms), ms[int(len(ms) * 0.95)]
    ratio = f"   {median / GOAL_MS:.2f}x the {GOAL_MS:g} ms goal" if goal else ""
    print(f"{name:<44} median {median:7.3f} ms   p95 {p95:7.3f} ms{ratio}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=2000)
    n = parser.parse_args().samples
    with tempfile.TemporaryDirectory() as tmp:
        tree = FakeTree(Path(tmp)).big()
        sampler = SensorSampler(tree.root, cpu_util=None, rediscover_s=3600)
        first = sampler.sample()
        files = len(list(tree.root.rglob("*")))
        print(
            f"tree: {len(first.temperatures)} temperatures ({files} paths), battery {first.battery is not None}, "
            f"{first.cpu.count} CPUs, problems {len(first.problems)}; {n} samples; 2 shared cores, noisy"
        )
        for _ in range(100):
            sampler.sample()  # warm caches
        full = timed(sampler.sample, n)
        report("full sample (SensorSampler.sample)", full, goal=True)
        report("discovery (once, then every 30 s)", timed(lambda: sampler._discover(Reader(sampler.root), 0.0), 200))
        dumped, line = first.model_dump(), first.model_dump_json()
        report("pydantic share: validate the snapshot", timed(lambda: Snapshot.model_validate(dumped), n))
        report("write a trace line (model_dump_json)", timed(first.model_dump_json, n))
        report("read a trace line (model_validate_json)", timed(lambda: Snapshot.model_validate_json(line), n))
        return 0 if statistics.median(full) < GOAL_MS else 1


if __name__ == "__main__":
    raise SystemExit(main())
