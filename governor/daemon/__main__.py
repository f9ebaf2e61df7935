"""`python -m governor.daemon [--debug] [--log-json] run ...`: the daemon's lean entry point.

`governor run` re-executes itself as this, so the daemon never imports the other subcommands' modules.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from governor import __version__, logs
from governor.daemon.cli import add_run, run_daemon
from governor.errors import GovernorError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="governor", description="The governor daemon.")
    parser.add_argument("--version", action="version", version=f"governor {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--log-json", action="store_true", default=None, help="log JSON lines even on a TTY")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run(sub).set_defaults(func=run_daemon)
    args = parser.parse_args(argv)
    logs.configure(json=args.log_json, level=10 if args.debug else 20)
    try:
        return run_daemon(args)
    except GovernorError as exc:
        if args.debug:
            raise
        print(f"governor: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
