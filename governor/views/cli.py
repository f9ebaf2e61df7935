"""`governor top`, `governor dashboard` and `governor plot`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from governor.daemon.client import ControlClient

DEFAULT_LISTEN = "127.0.0.1:8765"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("top", help="a live terminal view: temperatures against trips, state, tokens/s, decisions")
    p.add_argument("--control-socket", type=Path, help="the daemon's control socket (default: found)")
    p.add_argument(
        "--frames",
        type=int,
        metavar="N",
        help="print one frame after N updates and exit (default without a terminal: 0, the current status)",
    )
    p.set_defaults(func=_top)

    p = sub.add_parser("dashboard", help="a local web page with the live graphs and the decision log")
    p.add_argument("--control-socket", type=Path, help="the daemon's control socket (default: found)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT", help=f"default {DEFAULT_LISTEN}")
    p.add_argument("--no-control", action="store_true", help="read-only: no token, no holds or reload at all")
    p.set_defaults(func=_dashboard)

    p = sub.add_parser("plot", help="plot a recorded trace (governor record): temperature, state, tokens/s")
    p.add_argument("trace", type=Path, help="a trace in the replay format (governor record, governor lab --trace)")
    p.add_argument("--compare", type=Path, action="append", default=[], metavar="OTHER.jsonl", help="another trace")
    p.add_argument("--policy", default="default", help="the policy that decides the state band (default: default)")
    p.add_argument("-o", "--output", type=Path, help="the PNG to write (default: TRACE.png)")
    p.set_defaults(func=_plot)


def _client(args: argparse.Namespace) -> ControlClient:
    from governor.daemon.cli import default_control_socket
    from governor.daemon.client import ControlClient

    return ControlClient(args.control_socket or default_control_socket(), timeout_s=5.0)


def _top(args: argparse.Namespace) -> int:
    from rich.console import Console

    from governor.views.top import print_frames, run_live

    console = Console()
    if console.is_terminal and args.frames is None:
        return run_live(_client(args), console)
    print_frames(_client(args), args.frames or 0, console)
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from governor.views.dashboard import parse_listen, serve

    host, port = parse_listen(args.listen)
    return serve(_client(args), host, port, control=not args.no_control)


def _plot(args: argparse.Namespace) -> int:
    from governor.views.plot import plot_traces

    out = args.output or args.trace.with_suffix(".png")
    plot_traces([args.trace, *args.compare], out, policy=args.policy)
    print(f"wrote {out}")
    return 0
