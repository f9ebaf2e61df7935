"""`python -m governor.daemon [--debug] [--log-json] run ...`: the daemon's lean entry point.

`governor run` re-executes itself as this, so the daemon never imports the other subcommands' modules.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from governor import cli
from governor.daemon.cli import add_run, run_daemon


def _register_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_run(sub).set_defaults(func=run_daemon)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, registrars=[_register_run])


if __name__ == "__main__":
    raise SystemExit(main())
