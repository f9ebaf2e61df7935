"""Placeholder: this area's subcommands are registered here."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    del sub
