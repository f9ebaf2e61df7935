"""Shared fixtures: structlog reset around every test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from governor import logs


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    logs.reset()
    yield
    logs.reset()


@pytest.fixture
def captured_logs() -> Iterator[list[structlog.typing.EventDict]]:
    with structlog.testing.capture_logs() as entries:
        yield entries


@pytest.fixture(scope="session")
def demo_ladder() -> Path:
    """The demo model ladder TOML (random-weight GGUF models), written once per machine and reused across runs.

    Cached in the repository's `demo-models/` (what `make run` uses) unless GOVERNOR_DEMO_DIR names another directory;
    concurrent test runs are safe (see governor.engine.demo).
    """
    from governor.engine.demo import write_demo_models

    directory = os.environ.get("GOVERNOR_DEMO_DIR") or Path(__file__).resolve().parent.parent / "demo-models"
    return write_demo_models(Path(directory))
