"""What the daemon knows between ticks: the latest readings and decision, recent decisions, record subscribers.

`DaemonState.on_tick` is a GovernorLoop listener; the control server reads from here (under one lock), so a client
never talks to the loop or the engine directly.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from policies.decision import Decision
from sensors.snapshot import EngineObservation, Snapshot, TraceRecord

RECORD_QUEUE = 256  # a recorder that falls this far behind loses lines rather than slowing the loop


def _same(a: Decision, b: Decision) -> bool:
    return a.state == b.state and a.engine == b.engine and a.rule == b.rule


class DaemonState:
    def __init__(self, *, history: int = 200, wall: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._wall = wall
        self.snapshot: Snapshot | None = None
        self.observed: EngineObservation | None = None
        self.decision: Decision | None = None
        self.t: float | None = None
        self.since_wall: float | None = None  # when the current state began (wall clock, for people)
        self.ticks = 0
        self._history: deque[tuple[float, Decision]] = deque(maxlen=history)
        self._recorders: list[queue.Queue[TraceRecord | None]] = []

    def on_tick(self, t: float, snapshot: Snapshot, observed: EngineObservation | None, decision: Decision) -> None:
        wall = self._wall()
        with self._lock:
            if self.decision is None or decision.state != self.decision.state:
                self.since_wall = wall
            if not self._history or not _same(self._history[-1][1], decision):
                self._history.append((wall, decision))
            self.snapshot, self.observed, self.decision, self.t = snapshot, observed, decision, t
            self.ticks += 1
            recorders = list(self._recorders)
        if recorders:
            record = TraceRecord(**snapshot.model_dump(), t=t, engine=observed)
            for q in recorders:
                with contextlib.suppress(queue.Full):  # a stalled recorder loses lines; the loop never waits
                    q.put_nowait(record)

    def recent(self, n: int) -> list[dict[str, Any]]:
        """The last `n` distinct decisions, oldest first, each with the wall time it was first made."""
        with self._lock:
            items = list(self._history)[-n:]
        return [{"wall": wall, **d.model_dump(mode="json")} for wall, d in items]

    def subscribe(self) -> queue.Queue[TraceRecord | None]:
        q: queue.Queue[TraceRecord | None] = queue.Queue(maxsize=RECORD_QUEUE)
        with self._lock:
            self._recorders.append(q)
        return q

    def unsubscribe(self, q: queue.Queue[TraceRecord | None]) -> None:
        with self._lock:
            if q in self._recorders:
                self._recorders.remove(q)

    def close_recorders(self) -> None:
        with self._lock:
            recorders, self._recorders = self._recorders, []
        for q in recorders:
            with contextlib.suppress(queue.Full):  # its reader also stops on the server's shutdown flag
                q.put_nowait(None)

    def view(self) -> dict[str, Any]:
        with self._lock:
            return {
                "state": self.decision.state.value if self.decision else None,
                "since": self.since_wall,
                "rule": self.decision.rule if self.decision else None,
                "reason": self.decision.reason if self.decision else None,
                # The readings behind the reason (binding zone, its trip, the forecast, the budget): built with it.
                "basis": self.decision.readings if self.decision else None,
                "config": self.decision.engine.model_dump(mode="json") if self.decision else None,
                "engine": self.observed.model_dump(mode="json") if self.observed else None,
                "readings": self.snapshot.model_dump(mode="json") if self.snapshot else None,
                "ticks": self.ticks,
            }
