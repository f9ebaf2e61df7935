"""The simulator's speed: a 30-minute long chat on each shipped device, with the real loop and the real policy.

Goal: at least 1000x real time (a 30-minute chat in under 2 s). Also measured in the same run, for comparison:
the ungoverned baseline (the same loop with a trivial decider, so the difference is the policy's cost) and the
physics alone (the world stepped with no loop). Figures are noisy on a shared 2-core machine: take the best of N.
Usage: .venv/bin/python bench/bench_sim.py [--repeat N]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from governor import logs
from governor.lab.catalog import load_device
from governor.lab.deciders import decider_for, load_policy
from governor.lab.experiment import Run, simulate
from governor.lab.workload import load_workload
from governor.lab.world import World
from policies.decision import EngineConfig

GOAL_RATIO = 1000.0
PAIRS = [("raspberry-pi-5", "raspberry-pi"), ("phone", "android-termux"), ("fanless-laptop", "fanless-laptop")]


def best_of(repeat: int, run: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args, _unknown = parser.parse_known_args()  # run_all.py passes its arguments to every bench
    logs.configure(level=logging.WARNING)  # the loop logs each state change; a terminal would dominate the timing
    workload = load_workload("long-chat")
    sim_s = workload.duration_s
    failed = False
    print(f"30-minute long chat ({sim_s:.0f} simulated s), best of {args.repeat}; shared 2-core machine, noisy")
    print(f"{'device':16s} {'decider':16s} {'ticks':>6s} {'wall s':>7s} {'x real time':>12s} {'us/tick':>8s}")
    for device_name, policy_name in PAIRS:
        device = load_device(device_name)
        for name in (policy_name, "none"):
            policy = load_policy(name)
            runs: list[Run] = []

            def run() -> None:
                runs.append(simulate(device, decider_for(policy, device), workload, policy_name=name))  # noqa: B023

            wall = best_of(args.repeat, run)
            ratio = sim_s / wall
            n_ticks = runs[-1].ticks
            print(f"{device_name:16s} {name:16s} {n_ticks:6d} {wall:7.3f} {ratio:12.0f} {1e6 * wall / n_ticks:8.1f}")
            if name != "none" and ratio < GOAL_RATIO:
                failed = True

        def physics() -> None:
            world = World(device, workload)  # noqa: B023
            world.engine.apply(EngineConfig(threads=4, n_ctx=2048, model=device.engine.model[0].name), 0.0)  # noqa: B023
            world.advance_to(sim_s)

        wall = best_of(args.repeat, physics)
        steps = sim_s / device.sim.dt_s
        print(f"{device_name:16s} {'(physics only)':16s} {'':6s} {wall:7.3f} {sim_s / wall:12.0f}   "
              f"{1e6 * wall / steps:.1f} us per {device.sim.dt_s} s step")  # fmt: skip
    print(f"goal: >= {GOAL_RATIO:.0f}x real time with the real policy: {'FAILED' if failed else 'met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
