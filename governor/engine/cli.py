"""The engine's subcommands: `governor engine` (the serving process) and `governor demo-models`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from governor.engine.demo import register as demo_models
    from governor.engine.serve import register as engine

    engine(sub)
    demo_models(sub)
