"""Client holds (power-profiles-daemon's HoldProfile): tracked here, applied by the policy core.

A hold lives as long as its client's connection (or until its TTL); the loop asks for the ones in force at a tick.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from policies.decision import Hold


class HoldRegistry:
    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self._lock = threading.Lock()
        self._holds: dict[int, Hold] = {}
        self._ids = itertools.count(1)
        self._on_change = on_change

    def add(self, hold: Hold) -> int:
        with self._lock:
            cookie = next(self._ids)
            self._holds[cookie] = hold
        self._on_change()
        return cookie

    def release(self, cookie: int) -> bool:
        with self._lock:
            found = self._holds.pop(cookie, None) is not None
        if found:
            self._on_change()
        return found

    def in_force(self, t: float) -> tuple[Hold, ...]:
        """The holds not yet expired at `t`; expired ones are dropped here."""
        with self._lock:
            for cookie in [c for c, h in self._holds.items() if h.expires_t is not None and h.expires_t <= t]:
                del self._holds[cookie]
            return tuple(self._holds.values())

    def all(self) -> dict[int, Hold]:
        with self._lock:
            return dict(self._holds)
