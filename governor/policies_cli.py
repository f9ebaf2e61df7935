"""`governor policy check FILE`, `governor policy show NAME`, `governor replay TRACE --policy NAME_OR_FILE`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from govbase.errors import GovernorError
from policies.assemble import build_state_machine
from policies.cores import Cores
from policies.loader import load_policy, resolve, shipped_profiles
from policies.readings import ZoneFilter
from policies.replay import decision_text, dumps, read_trace, replay
from policies.schema import Policy, all_of
from sensors.sampler import SensorSampler


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = sub.add_parser("policy", help="check or show a policy file")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    check = policy_sub.add_parser("check", help="validate a policy file (exit 2 with FILE:LINE: field: message)")
    check.add_argument("file", help="a policy TOML file or a shipped profile name")
    check.set_defaults(func=_check)
    show = policy_sub.add_parser("show", help=f"print a policy ({', '.join(shipped_profiles())} or a file)")
    show.add_argument("name", help="a shipped profile name or a policy TOML file")
    show.add_argument("--json", action="store_true", help="print the validated policy with every default filled in")
    show.add_argument(
        "--root",
        type=Path,
        help="also print the numbers it resolves to on the device whose sysfs/procfs are under this directory "
        "(/ for this machine): each trusted zone's trip, hot, setpoint and critical, and each state's threads",
    )
    show.set_defaults(func=_show)

    rep = sub.add_parser("replay", help="run a policy over a recorded trace, one decision per line")
    rep.add_argument(
        "trace", help="JSON lines: a `governor sensors --json` snapshot plus t and optional engine; - = stdin"
    )
    rep.add_argument("--policy", default="default", help="a shipped profile name or a policy TOML file")
    rep.add_argument("--json", action="store_true", help="one JSON object per decision")
    rep.add_argument("--models", type=Path, help="model ladder TOML: choose tiers and fit memory from GGUF headers")
    rep.set_defaults(func=_replay)


def _check(args: argparse.Namespace) -> int:
    policy = load_policy(args.file)
    print(f"{resolve(args.file)}: ok ({policy.name})")
    return 0


def _show(args: argparse.Namespace) -> int:
    path = resolve(args.name)
    policy = load_policy(path)
    if args.root is not None:
        resolved = _resolved(policy, args.root)
        if args.json:
            print(json.dumps({"policy": policy.model_dump(mode="json"), "resolved": resolved}, indent=2))
        else:
            print(path.read_text(), end="")
            print(f"\n# Resolved on {args.root}:")
            for zone in resolved["zones"]:
                print(
                    f"#   {zone['zone']} {zone['temp_c']:.1f} °C: trip {zone['trip_c']:g} °C ({zone['trip_source']}), "
                    f"hot from {zone['hot_enter_c']:g} °C until under {zone['hot_exit_c']:g} °C, setpoint "
                    f"{zone['setpoint_c']:g} °C, critical {zone['critical_c']:g} °C"
                )
            if not resolved["zones"]:
                print("#   no trusted zone reads here: the fallback trip applies")
            threads = ", ".join(f"{state} {n}" for state, n in resolved["threads"].items())
            print(f"#   threads on {resolved['cpus']} CPUs{resolved['clusters']}: {threads}")
        return 0
    if args.json:
        print(json.dumps(policy.model_dump(mode="json"), indent=2, ensure_ascii=False))
    else:
        print(path.read_text(), end="")
    return 0


def _resolved(policy: Policy, root: Path) -> dict[str, Any]:
    """What the policy's relative numbers are on the device under `root`: thresholds per trusted zone (each against
    its own trip), and each state's thread count on its CPUs (policies.cores)."""
    snapshot = SensorSampler(root, cpu_util=None).sample()
    zones = [t._asdict() for t in ZoneFilter(policy.thermal).thresholds(snapshot)]
    cpu = snapshot.cpu
    cores = Cores(cpu.clusters, cpu.count)
    threads = {state.value: cores.best(all_of(p.thread_limit, cpu.count)) for state, p in policy.states.items()}
    clusters = ", ".join(f"{len(c.cpus)} at {c.capacity:.2f}" for c in cpu.clusters)
    return {"zones": zones, "cpus": cpu.count, "clusters": f" ({clusters})" if clusters else "", "threads": threads}


def _replay(args: argparse.Namespace) -> int:
    governor = build_state_machine(args.policy, args.models)
    render = dumps if args.json else decision_text
    if args.trace == "-":
        stream = sys.stdin
    else:
        try:
            stream = open(args.trace, encoding="utf-8")  # noqa: SIM115 - closed below, stdin is not ours to close
        except OSError as exc:
            raise GovernorError(f"{args.trace}: cannot read trace: {exc.strerror}") from exc
    try:
        for decision in replay(read_trace(stream, "<stdin>" if stream is sys.stdin else args.trace), governor):
            print(render(decision))
    finally:
        if stream is not sys.stdin:
            stream.close()
    return 0
