"""`python -m governor.engine [--debug] [--log-json] engine ...`: the engine's lean entry point.

`governor engine` re-executes itself as this, and the daemon starts its engine child with it, so an engine never
imports the other subcommands' modules.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from governor import cli
from governor.engine.serve import add_engine, run


def _register_engine(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_engine(sub).set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, registrars=[_register_engine])


if __name__ == "__main__":
    raise SystemExit(main())
