"""`governor engine --slow-callback-ms MS`: report every event-loop step that holds the loop longer than MS.

asyncio's debug mode does the measuring (and checks that other threads only use the loop's thread-safe calls);
each slow step becomes an `engine.slow_callback` log event. On a shared machine a step can also take long because the
OS gave the loop's thread no CPU (a preemption while two cores run four busy processes), which says nothing about
the engine: the watched loop's clock leaves out the time its thread spent waiting in the CPU run queue (Linux
schedstat), so what remains is the time it worked or waited for a lock, the GIL included.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time

import structlog

log = structlog.get_logger("governor.engine")

SCHEDSTAT = "/proc/thread-self/schedstat"  # ns on a CPU, ns waiting in the run queue, timeslices


class WatchedLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock stands still while its thread waits for a CPU.

    Its timers stretch by the same waits (nothing else in the engine depends on their exact length); plain
    monotonic time where schedstat is not available.
    """

    def __init__(self) -> None:
        super().__init__()
        self._thread = threading.get_ident()
        try:
            self._schedstat: int | None = os.open(SCHEDSTAT, os.O_RDONLY)
        except OSError:
            self._schedstat = None

    def time(self) -> float:
        now = time.monotonic()
        if self._schedstat is None or threading.get_ident() != self._thread:
            return now
        return now - int(os.pread(self._schedstat, 64, 0).split()[1]) / 1e9

    def close(self) -> None:
        super().close()
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None


class _LoopReport(logging.Handler):
    """asyncio's debug-mode warnings as structured log events: a slow step is `engine.slow_callback`."""

    _took = re.compile(r"took (\d+(?:\.\d+)?) seconds")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        took = self._took.search(message)
        if message.startswith("Executing") and took:
            where = message[len("Executing") : took.start()].strip()
            log.warning("engine.slow_callback", seconds=float(took.group(1)), callback=where)
        else:
            log.warning("engine.asyncio", level=record.levelname, message=message)


def watch(loop: asyncio.AbstractEventLoop, threshold_s: float) -> None:
    """Debug mode on `loop`, with every step longer than `threshold_s` logged."""
    loop.set_debug(True)
    loop.slow_callback_duration = threshold_s
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addHandler(_LoopReport(logging.WARNING))
    asyncio_log.propagate = False
