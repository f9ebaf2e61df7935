"""Issue 10's goals checked in the lab: every shipped device x workload, its own policy and `default`, against `none`.

Goals per cell: tokens >= 1.0 x none (never below 0.97), J/token <= none, kernel-throttled <= 2 % of the time,
peak <= trip. The lab runs in virtual time with seeded workloads, so the figures are deterministic: the machine's
load changes only how long this takes. Prints a markdown table (cells that miss a goal are marked) and exits 1 if
any cell misses one. The throttled column also shows the world alone: the same device and workload with no question
asked (the engine loaded and idle, the other programs as they are), i.e. what no policy of the engine's can take
away; a throttling or peak miss where the world alone throttles more than the goal allows, or passes the trip, is marked
"world-bound", and a tokens miss where `none` leads only by the tokens of answers the kernel killed mid-stream (they
were streamed, then the client got an error) says so.
`--engine llama-server` runs every cell on llama.cpp's own server instead of the built-in engine (issue 30): a setting
change restarts it (slot restored where llama.cpp can), so the same policies pay what a change costs there.
Usage: .venv/bin/python bench/lab_grid.py [--workload W ...] [--device D ...] [--engine E] [--jobs N]
"""

from __future__ import annotations

import argparse
import logging
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from governor import logs
from governor.lab.catalog import load_device
from governor.lab.deciders import NONE, decider_for, load_run
from governor.lab.experiment import Summary, simulate
from governor.lab.files import shipped
from governor.lab.workload import load_workload

DEVICE_POLICY = {
    "pi4-closed-case": "raspberry-pi",
    "raspberry-pi-5": "raspberry-pi",
    "n100-fanless-8b": "fanless-laptop",
    "fanless-laptop": "fanless-laptop",
    "phone": "android-termux",
}
WORKLOADS = ["long-chat", "burst", "memory-squeeze", "idle-day"]
MAX_THROTTLED_PCT = 2.0
WORLD = "world"  # a job's policy: `none` with no question asked


def one(job: tuple[str, str, str, str | None]) -> Summary:
    device_name, policy_name, workload_name, engine = job
    logs.configure(level=logging.WARNING)  # the loop logs every state change
    device = load_device(device_name, engine)
    workload = load_workload(workload_name)
    if policy_name == WORLD:
        workload, policy_name = workload.without_questions(), NONE
    decider = decider_for(load_run(policy_name), device)
    return simulate(device, decider, workload, policy_name=policy_name).summary


def misses(s: Summary, none: Summary, world: Summary) -> list[str]:
    out = []
    if s.tokens < none.tokens:
        killed = f"tokens (none's lead is {none.lost_tokens:g} tokens of answers killed mid-stream)"
        out.append(killed if s.tokens - s.lost_tokens >= none.tokens - none.lost_tokens else "tokens")
    if s.j_per_token is not None and none.j_per_token is not None and s.j_per_token > none.j_per_token:
        out.append("J/token")
    if s.throttled_pct > MAX_THROTTLED_PCT:
        out.append("throttled (world-bound)" if world.throttled_pct > MAX_THROTTLED_PCT else "throttled")
    if s.peak_c > s.trip_c:
        out.append("peak (world-bound)" if world.peak_c > s.trip_c else "peak")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", nargs="+", default=list(DEVICE_POLICY), choices=list(DEVICE_POLICY))
    ap.add_argument("--workload", nargs="+", default=WORKLOADS, choices=shipped("workloads"))
    ap.add_argument("--engine", choices=["llama-cpp-python", "llama-server"], help="default: each device file's")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    policies = (NONE, WORLD)
    jobs = [
        (d, p, w, args.engine)
        for d in args.device
        for w in args.workload
        for p in (*policies, DEVICE_POLICY[d], "default")
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = dict(zip(jobs, pool.map(one, jobs), strict=True))
    print(
        "| device | policy | workload | tokens ÷ none | J/token ÷ none | kernel throttled (none; the world alone) "
        "| peak / trip °C |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    failed = 0
    for d in args.device:
        for p in (DEVICE_POLICY[d], "default"):
            for w in args.workload:
                s, none, world = (results[(d, q, w, args.engine)] for q in (p, NONE, WORLD))
                jt = "-" if s.j_per_token is None or not none.j_per_token else f"{s.j_per_token / none.j_per_token:.3f}"
                bad = misses(s, none, world)
                failed += bool(bad)
                mark = f" **misses: {', '.join(bad)}**" if bad else ""
                print(
                    f"| {d} | `{p}` | {w} | {s.tokens / none.tokens:.3f} | {jt} | "
                    f"{s.throttled_pct:.1f} % ({none.throttled_pct:.1f} %; {world.throttled_pct:.1f} %) | "
                    f"{s.peak_c:.1f} / {s.trip_c:g} |{mark}"
                )
    print(f"\n{failed} of {len(args.device) * 2 * len(args.workload)} cells miss a goal")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
