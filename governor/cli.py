"""`governor`: one console script; each area registers its own subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from govbase.errors import GovernorError
from governor import __version__, logs

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _registrars() -> list[Register]:
    from governor.benchdevice import register as bench_device
    from governor.daemon.cli import register as daemon
    from governor.demo.cli import register as demo_models
    from governor.engine.cli import register as engine
    from governor.lab.cli import register as lab
    from governor.policies_cli import register as policies
    from governor.sensors_cli import register as sensors
    from governor.views.cli import register as views

    return [sensors, policies, engine, demo_models, bench_device, daemon, lab, views]


def build_parser(registrars: Sequence[Register] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="governor", description="Thermal- and power-aware governor for on-device LLM inference."
    )
    parser.add_argument("--version", action="version", version=f"governor {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--log-json", action="store_true", default=None, help="log JSON lines even on a TTY")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in _registrars() if registrars is None else registrars:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None, registrars: Sequence[Register] | None = None) -> int:
    """`registrars` limits the subcommands (the daemon's lean entry point registers only `run`)."""
    parser = build_parser(registrars)
    args = parser.parse_args(argv)
    logs.configure(json=args.log_json, level=10 if args.debug else 20)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except GovernorError as exc:
        if args.debug:
            raise
        print(f"governor: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
