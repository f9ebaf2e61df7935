"""Shared fixtures: structlog reset around every test."""

from __future__ import annotations

from collections.abc import Iterator

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
