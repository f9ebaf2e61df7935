"""Test helpers shared by every area."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(check: Callable[[], T], *, timeout_s: float = 10.0, interval_s: float = 0.02) -> T:
    """Poll `check` until it returns a truthy value (returned) or stops raising AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
            last: BaseException | None = AssertionError(f"{check!r} returned {result!r}")
        except AssertionError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {last}") from last
        time.sleep(interval_s)
