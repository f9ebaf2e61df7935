"""The engine as the loop sees it, kept current by the engine itself: one open `GET /engine/events` stream.

A tick reads `latest` (no I/O). The engine writes a line when it turns busy or idle, after a settings change, every
second while generating, and every `heartbeat_s` otherwise; a request arriving at an idle engine therefore wakes the
loop at once (`on_change`), which is what lets a calm loop tick slowly. The stream doubles as a liveness signal:
`connected` drops the moment the engine process goes away (EOF), and `last_seen_s` stops moving when its event
loop hangs (the client errors out after three silent heartbeats).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from typing import Protocol

import structlog

from governor.engine.client import EngineError, EngineStatus
from sensors.snapshot import EngineObservation

HEARTBEAT_S = 30.0
RETRY_S = (0.05, 2.0)  # first and longest wait before reconnecting


class StatusSource(Protocol):
    """governor.engine.client.EngineClient, as the watch uses it."""

    def events(self, *, heartbeat_s: float | None = None) -> Generator[EngineStatus, None, None]: ...

    def interrupt_streams(self) -> None: ...


class EngineWatch:
    def __init__(
        self,
        source: StatusSource,
        *,
        on_change: Callable[[], None] = lambda: None,
        heartbeat_s: float | None = HEARTBEAT_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.heartbeat_s = heartbeat_s
        self._on_change = on_change
        self._monotonic = monotonic
        self.latest: EngineObservation | None = None
        self.status: EngineStatus | None = None  # the whole last line (settings, pid): the supervisor's probe reads it
        self.last_seen_s: float | None = None  # monotonic time of the last line
        self.lines = 0
        self._stop = threading.Event()
        self._start_lock = threading.Lock()
        self._kick = threading.Event()  # cuts the wait before reconnecting short
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)
        self._log = structlog.get_logger("governor.engine.watch")

    @property
    def connected(self) -> bool:
        return self.latest is not None

    def start(self) -> None:
        with self._start_lock:
            if self._thread.ident is None and not self._stop.is_set():
                self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._kick.set()
        self.source.interrupt_streams()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def fresh(self, max_age_s: float) -> EngineStatus | None:
        """The last status when a line came within `max_age_s`: the engine's event loop is alive. With a heartbeat
        this is the supervisor's liveness probe, without a round trip (None: silent or not connected)."""
        status, seen = self.status, self.last_seen_s
        if status is None or seen is None or self._monotonic() - seen > max_age_s:
            return None
        return status

    def kick(self) -> None:
        """The engine (re)started or stopped: connect now rather than after the back-off (the first kick starts)."""
        self._kick.set()
        if self._thread.ident is None:
            self.start()

    def _run(self) -> None:
        delay = RETRY_S[0]
        failing: str | None = None
        while not self._stop.is_set():
            try:
                for status in self.source.events(heartbeat_s=self.heartbeat_s):
                    if status is self.status:  # a heartbeat with nothing new: alive, and that is all
                        self.last_seen_s = self._monotonic()
                        self.lines += 1
                        continue
                    self.status = status
                    self._seen(status.observation())
                    delay = RETRY_S[0]
                    if failing is not None:
                        self._log.info("engine status stream connected")
                        failing = None
            except EngineError as exc:
                if failing != exc.reason and not self._stop.is_set():
                    self._log.info("engine status stream closed", error=exc.reason)
                    failing = exc.reason
            except Exception:  # an unknown fault must not end the watch: the loop would lose the engine for good
                self._log.exception("engine status stream failed")
                failing = "internal error"
            self.status = None
            if self.latest is not None:
                self.latest = None
                self._on_change()
            self._kick.wait(delay)
            self._kick.clear()
            delay = min(2 * delay, RETRY_S[1])

    def _seen(self, observed: EngineObservation) -> None:
        previous, self.latest = self.latest, observed
        self.last_seen_s = self._monotonic()
        self.lines += 1
        if previous is None or previous.busy != observed.busy or previous.model != observed.model:
            self._on_change()
