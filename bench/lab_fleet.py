"""Issue 27's goals on a randomized fleet: N random devices (governor/lab/fleet.py) x the shipped workloads, a policy
against `none` and the world alone, and the distribution of every "Done when" goal.

The lab runs in virtual time with seeded devices and workloads: the figures are deterministic, the machine's load
changes only how long this takes (about 1 s of CPU per device and workload). Seeds: 1 is the tuning fleet (what
the policy's numbers were chosen on), 2 the report fleet (never tuned on); say which when quoting figures.
Exits 1 when any cell misses a goal or the winnable cells' median misses.

Usage: .venv/bin/python bench/lab_fleet.py [--seed 2] [--devices 200] [--policy default] [--class phone]
           [--workload W ...] [--jobs 2] [--json cells.jsonl] [--worst 8] [--constants 0]
`--constants N`: on the first N devices, each cell also runs a grid of constant settings (threads: 1, the big cores,
all cores; clock 100/80/60 % where writable) and the policy is compared with the best of them in hindsight.
A cell alone: governor simulate --device fleet:SEED:INDEX[:CLASS] --workload W --compare default
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from governor import logs
from governor.lab.deciders import NONE, decider_for, load_run
from governor.lab.device import DeviceSpec
from governor.lab.experiment import Summary, simulate
from governor.lab.fleet import CLASSES, random_device
from governor.lab.goals import WIN_MEDIAN, Cell, judge, misses, winnable_median
from governor.lab.workload import load_workload

WORKLOADS = ["long-chat", "burst", "background-load", "memory-squeeze-1g", "busy-machine"]
WORLD = "world"  # a job's policy: `none` with no question asked
Job = tuple[int, int, str | None, str, str]  # seed, index, class, workload, policy


def run(job: Job) -> Summary:
    seed, index, cls, workload_name, policy_name = job
    logs.configure(level=logging.WARNING)
    device = random_device(seed, index, cls)
    workload = load_workload(workload_name)
    if policy_name == WORLD:
        workload, policy_name = workload.without_questions(), NONE
    return simulate(device, decider_for(load_run(policy_name), device), workload, policy_name=policy_name).summary


def constants(device: DeviceSpec) -> list[str]:
    """A grid of fixed settings: 1 thread, the big cores, all cores; x the clock at 100/80/60 % where writable."""
    cpu = device.cpu
    threads = sorted({1, cpu.cores - cpu.little_cores, cpu.cores})
    freqs = (1.0, 0.8, 0.6) if cpu.freq_writable else (1.0,)
    return [f"constant:threads={n},freq={f}" for n in threads for f in freqs]


def best_constant(cells: list[Cell], results: dict[Job, Summary], hindsight: list[Job]) -> None:
    """The policy's tokens over the best constant setting's, per cell (a setting whose peak reached the trip, or that
    was OOM-killed or lost answers, does not count)."""
    best: dict[tuple[str, str], Summary] = {}
    for job in hindsight:
        s = results[job]
        if s.peak_c >= s.trip_c or s.oom_kills or s.failed:
            continue
        key = (s.device, s.workload)
        if key not in best or s.tokens > best[key].tokens:
            best[key] = s
    ratios = sorted(
        (c.governed.tokens / b.tokens, c.device, c.workload, b.policy)
        for c in cells
        if (b := best.get((c.device, c.workload))) is not None and b.tokens > 0
    )
    if not ratios:
        return
    values = [r[0] for r in ratios]
    print(
        f"\ntokens ÷ best constant (hindsight, {len(ratios)} cells): min {values[0]:.3f}, "
        f"median {values[len(values) // 2]:.3f}, max {values[-1]:.3f}; below 0.95 in {sum(v < 0.95 for v in values)}"
    )
    for ratio, device, workload, policy in ratios[:3]:
        print(f"  {device} {workload}: {ratio:.3f} (best: {policy})")


def fmt(v: float) -> str:
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=2, help="1: the tuning fleet; 2: the report fleet (default)")
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--first", type=int, default=0, help="index of the first device")
    ap.add_argument("--class", dest="cls", choices=CLASSES, help="devices of this class only")
    ap.add_argument("--policy", default="default")
    ap.add_argument("--workload", nargs="+", default=WORKLOADS)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write every cell's three summaries here (JSON lines)")
    ap.add_argument("--worst", type=int, default=8, help="cells listed per goal missed")
    ap.add_argument("--constants", type=int, default=0, help="devices also run against the best constant setting")
    args = ap.parse_args()

    indices = range(args.first, args.first + args.devices)
    jobs: list[Job] = [
        (args.seed, i, args.cls, w, p) for i in indices for w in args.workload for p in (args.policy, NONE, WORLD)
    ]
    hindsight = [
        (args.seed, i, args.cls, w, c)
        for i in indices[: args.constants]
        for w in args.workload
        for c in constants(random_device(args.seed, i, args.cls))
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = dict(zip(jobs + hindsight, pool.map(run, jobs + hindsight, chunksize=4), strict=True))
    cells = []
    for i in indices:
        for w in args.workload:
            got = [results[(args.seed, i, args.cls, w, p)] for p in (args.policy, NONE, WORLD)]
            cells.append(Cell(got[0].device, w, *got))
    if args.json:
        with args.json.open("w") as out:
            for c in cells:
                row = {"device": c.device, "workload": c.workload, "misses": misses(c)}
                row |= {k: getattr(c, k).model_dump() for k in ("governed", "none", "world")}
                out.write(json.dumps(row) + "\n")

    classes = Counter(random_device(args.seed, i, args.cls).description.split(":")[0].split()[-1] for i in indices)
    print(
        f"fleet seed {args.seed} ({'tuning' if args.seed == 1 else 'report'}), {args.devices} devices "
        f"({', '.join(f'{n} {k}s' for k, n in sorted(classes.items()))}) x {len(args.workload)} workloads = "
        f"{len(cells)} cells; policy `{args.policy}` against `none`\n"
    )
    print("| goal | target | min | p5 | median | p95 | max | cells missing |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    verdicts = judge(cells)
    failed = 0
    for v in verdicts:
        q = " | ".join(fmt(x) for x in v.quantiles())
        failed += bool(v.misses)
        print(f"| {v.goal.name} | {v.goal.target} | {q} | {len(v.misses)} of {len(v.values)} |")
    n_win, med = winnable_median(cells)
    med_ok = med is not None and med >= WIN_MEDIAN
    print(
        f"\nwinnable cells (none throttled > 5 %, OOM-killed or shut down): {n_win} of {sum(c.judged for c in cells)}; "
        f"median tokens ÷ none "
        f"{'-' if med is None else f'{med:.3f}'} (goal >= {WIN_MEDIAN}){'' if med_ok else ' **misses**'}"
    )
    if off := sum(not c.judged for c in cells):
        print(f"cells the world alone shuts down (its programs take a zone to critical), not judged: {off}")
    for v in verdicts:
        if v.misses:
            print(f"\n{v.goal.name} ({v.goal.target}) missed in {len(v.misses)} cells; worst:")
            for c, value in v.misses[: args.worst]:
                print(f"  {c.device} {c.workload}: {fmt(value)} ({'; '.join(misses(c))})")
    if hindsight:
        best_constant(cells, results, hindsight)
    bad = sum(bool(misses(c)) for c in cells)
    print(f"\n{bad} of {len(cells)} cells miss a goal")
    return 1 if failed or not med_ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
