"""Injected time: the daemon runs on `RealClock`, the simulator runs the same loop on `VirtualClock`."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Signal(Protocol):
    """What a clock waits on: `threading.Event`, or the loop's `Wake`."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class Wake:
    """`threading.Event`'s set / is_set / clear / wait for one waiter (the loop), on a bare lock held while unset: a
    wait is one futex with a timeout. `Event.wait` builds a Condition waiter each call (a lock allocated, a list
    appended, the condition's lock taken and given back): 0.17-0.19 ms of CPU per wake after 0.25 s asleep on the
    2-core VM, against 0.12 for a lock, and the mitigating loop wakes four times a second (issue 16).
    Any thread may set it. A `set` racing a `clear` may leave one spurious early wake-up (the loop ticks early, as
    for any wake), never a lost one after the `clear`."""

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        self._flag = True
        with contextlib.suppress(RuntimeError):  # already released: set twice before the waiter woke
            self._lock.release()

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        self._flag = False
        self._lock.acquire(blocking=False)  # take back a release no wait consumed

    def wait(self, timeout: float | None = None) -> bool:
        if not self._flag:
            self._lock.acquire(True, -1 if timeout is None else timeout)
        return self._flag


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def wait(self, event: Signal, timeout_s: float) -> bool:
        """Wait until `event` is set or `timeout_s` passes; True if the event was set (tuned's terminate.wait)."""
        ...


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def wait(self, event: Signal, timeout_s: float) -> bool:
        return event.wait(max(0.0, timeout_s))


class VirtualClock:
    """Time moves only when the loop waits: a 30-minute run takes as long as its ticks' work.

    `call_at` schedules a callback at a virtual time (e.g. a simulated udev event that sets the loop's `wake`): a
    `wait` spanning it stops there, runs it, and returns early if that set the event, as a real wait would.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s
        self._alarms: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties run in the order they were scheduled

    def now(self) -> float:
        return self._now

    def advance(self, dt_s: float) -> None:
        if dt_s < 0:
            raise ValueError(f"cannot move a clock backwards by {dt_s} s")
        self._now += dt_s

    def call_at(self, t: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._alarms, (t, next(self._order), callback))

    def wait(self, event: Signal, timeout_s: float) -> bool:
        if event.is_set():
            return True
        deadline = self._now + max(0.0, timeout_s)
        while self._alarms and self._alarms[0][0] <= deadline:
            at, _, callback = heapq.heappop(self._alarms)
            self._now = max(self._now, at)
            callback()
            if event.is_set():
                return True
        self._now = deadline
        return event.is_set()
