"""The engine's subcommand: `governor engine` (the serving process)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from governor.engine.serve import register as engine

    engine(sub)
