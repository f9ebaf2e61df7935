"""The lab's subcommands: `governor simulate`, `governor calibrate` and `governor sweep`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from govbase.errors import GovernorError
from governor import logs


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from governor.lab.files import shipped

    devices, workloads = ", ".join(shipped("devices")), ", ".join(shipped("workloads"))
    p = sub.add_parser(
        "simulate",
        help="run a policy on a simulated device and workload (virtual time)",
        description="Run the daemon's loop and a policy against a simulated device on a virtual clock.",
    )
    p.add_argument("--device", required=True, help=f"a shipped device ({devices}) or a file")
    p.add_argument(
        "--policy",
        required=True,
        help="a shipped policy, a policy file, `none` (ungoverned) or `constant:threads=N,freq=R` (fixed setting)",
    )
    p.add_argument("--workload", default="long-chat", help=f"a shipped workload ({workloads}) or a file")
    p.add_argument(
        "--engine",
        choices=["llama-cpp-python", "llama-server"],
        help="the engine it runs (default: the device file's): llama-server changes settings by a restart",
    )
    p.add_argument("--minutes", type=float, help="simulated minutes (default: the workload's length)")
    p.add_argument("--seed", type=int, help="override the workload's seed")
    p.add_argument("--json", action="store_true", help="print the summary (or one per policy) as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="plot temperature, state and tokens/s")
    p.add_argument("--trace", type=Path, metavar="FILE.jsonl", help="write the run as a trace (replay format)")
    p.add_argument(
        "--compare", nargs="+", metavar="POLICY", help="also run these policies (and `none`) and print one table"
    )
    p.set_defaults(func=_simulate)

    c = sub.add_parser(
        "calibrate",
        help="fit a device's thermal model to a recorded trace",
        description="Fit R and C of both thermal stages and the ambient to a `governor record` trace.",
    )
    c.add_argument("trace", type=Path, metavar="TRACE")
    c.add_argument("--device", default="raspberry-pi-5", help="the device file to start from (power model, zones)")
    c.add_argument("--threads", type=int, help="engine threads while busy, when the trace has no CPU utilisation")
    c.add_argument("--zone", metavar="LABEL", help="the die's zone in the trace (default: the device file's)")
    c.add_argument("--case-zone", metavar="LABEL", help="a case/skin zone in the trace, fitted too when given")
    c.add_argument("--out", type=Path, metavar="DEVICE.toml", help="write the calibrated device file here")
    c.set_defaults(func=_calibrate)

    s = sub.add_parser(
        "sweep",
        help="sweep a policy's thresholds on a simulated device (all cores)",
        description="Run a policy over a grid of overridden fields; the best keeps below the trip with most tokens.",
    )
    s.add_argument("--device", required=True)
    s.add_argument("--policy", required=True, help="a policy, or `constant` to sweep threads=... and freq=...")
    s.add_argument("--workload", default="long-chat")
    s.add_argument(
        "--param", action="append", required=True, metavar="KEY=V1,V2", help="e.g. thermal.hot_margin_c=3,5,8"
    )
    s.add_argument("--minutes", type=float)
    s.add_argument("--out", type=Path, default=Path("sweep.csv"), metavar="results.csv")
    s.add_argument("--plot", type=Path, metavar="sweep.png")
    s.add_argument("--jobs", type=int, help="worker processes (default: every core)")
    s.set_defaults(func=_sweep)


def _quiet(args: argparse.Namespace) -> None:
    """The loop logs every state change; in an experiment those go to the plot, not the terminal."""
    if not args.debug:
        logs.configure(json=args.log_json, level=logging.WARNING)


def _simulate(args: argparse.Namespace) -> int:
    from governor.lab.catalog import load_device
    from governor.lab.deciders import NONE, decider_for, load_run
    from governor.lab.experiment import simulate
    from governor.lab.report import plot, print_comparison, summary_lines
    from governor.lab.workload import load_workload

    _quiet(args)
    device = load_device(args.device, args.engine)
    workload = load_workload(args.workload)
    names = [args.policy]
    if args.compare:
        names += [n for n in args.compare if n not in names]
        if NONE not in names:
            names.append(NONE)
    policies = [(name, load_run(name)) for name in names]  # every file is checked before the first run
    runs = []
    for i, (name, policy) in enumerate(policies):
        trace = args.trace.open("w") if args.trace is not None and i == 0 else None
        try:
            decider = decider_for(policy, device)
            run = simulate(
                device, decider, workload, policy_name=name, minutes=args.minutes, seed=args.seed, trace=trace
            )
            runs.append(run)
        finally:
            if trace is not None:
                trace.close()
    if args.json:
        dumped = [r.summary.model_dump() for r in runs]
        print(json.dumps(dumped if args.compare else dumped[0], indent=2))
    elif args.compare:
        print_comparison(runs)
    else:
        print("\n".join(summary_lines(runs[0].summary)))
    if args.plot is not None:
        plot(runs, args.plot)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from governor.lab.calibrate import calibrate, device_text, read_trace
    from governor.lab.catalog import load_device
    from governor.lab.files import resolve

    _quiet(args)
    base_path = resolve("devices", args.device)
    device = load_device(base_path)
    result = calibrate(read_trace(args.trace), device, args.threads, args.zone, args.case_zone)
    th = result.thermal
    print(
        f"fitted to {result.samples} samples (power from the {result.power_source}): RMSE {result.rmse_c:.2f} °C\n"
        f"ambient {result.ambient_c:.1f} °C; die->case {th.r_die_case_k_per_w:.3g} K/W, {th.c_die_j_per_k:.3g} J/K; "
        f"case->ambient {th.r_case_ambient_k_per_w:.3g} K/W, {th.c_case_j_per_k:.3g} J/K"
    )
    if args.out is not None:
        try:
            args.out.write_text(device_text(base_path.read_text(), result, args.trace))
        except OSError as exc:
            raise GovernorError(f"{args.out}: cannot write: {exc.strerror}") from exc
        print(f"wrote {args.out}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from governor.lab.catalog import load_device
    from governor.lab.deciders import CONSTANT, load_policy
    from governor.lab.sweep import best, parse_param, plot, sweep, write_csv
    from governor.lab.workload import load_workload
    from policies import Policy

    _quiet(args)
    params = [parse_param(p) for p in args.param]
    device, workload = load_device(args.device), load_workload(args.workload)
    policy: Policy | str | None = CONSTANT if args.policy == CONSTANT else load_policy(args.policy)
    if policy is None:
        raise GovernorError("--policy none has no thresholds to sweep")
    results = sweep(device, policy, workload, params, minutes=args.minutes, jobs=args.jobs)
    write_csv(results, args.out)
    if args.plot is not None:
        plot(results, params, args.plot)
    for r in results:
        if r.error:
            print(f"skipped {r.values}: {r.error}")
    top = best(results)
    print(f"{len(results)} runs -> {args.out}")
    if top is None or top.summary is None:
        print("no combination kept the peak below the trip without an OOM kill")
        return 1
    s = top.summary
    print(
        f"best: {', '.join(f'{k}={v}' for k, v in top.values.items())}: {s.tokens:,.0f} tokens, "
        f"peak {s.peak_c:.1f} °C (trip {s.trip_c:.1f}), {s.throttled_pct:.1f} % throttled, "
        f"{s.j_per_token or 0:.2f} J/token"
    )
    return 0
