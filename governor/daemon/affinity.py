"""The thread placement actuator: the engine's threads on the CPUs the decision names (`Decision.affinity`).

On cores of different speed llama.cpp's threads wait at every step for the slowest: n threads belong on the n fastest
cores (or, while power is short, on the most efficient cluster; policies/cores.py). `sched_setaffinity` on every
thread of the engine process (`/proc/PID/task/*`); threads it starts later inherit the mask of the thread that starts
them (sched(7)), so the whole engine follows. A new engine process (a restart) gets the mask again at the next tick.
None, or restore(): every CPU this daemon may use (what the engine started with). An engine that refuses (EPERM: not
ours; ESRCH: gone) is reported in status(), never raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import structlog

from policies.decision import Decision

TASKS = "/proc/{pid}/task"


class Affinity:
    name = "affinity"

    def __init__(self, pid: Callable[[], int | None], *, proc: str = TASKS) -> None:
        self._pid = pid
        self._tasks = proc
        self._all: set[int] = os.sched_getaffinity(0)  # what the engine may use at most: this daemon's own CPUs
        self._applied: tuple[int | None, frozenset[int] | None] = (None, None)  # (pid, cpus) last written
        self.error: str | None = None
        self._log = structlog.get_logger("governor.affinity")

    def apply(self, decision: Decision) -> None:
        pid = self._pid()
        cpus = frozenset(c for c in decision.affinity or () if c in self._all) or None
        if pid is None or (pid, cpus) == self._applied:
            return
        self._write(pid, set(cpus) if cpus else self._all)
        self._applied = (pid, cpus)

    def restore(self) -> None:
        pid = self._pid()
        if pid is not None and self._applied[1] is not None:
            self._write(pid, self._all)
        self._applied = (pid, None)

    def status(self) -> dict[str, Any]:
        cpus = self._applied[1]
        return {"cpus": sorted(cpus) if cpus else None, "pid": self._applied[0], "error": self.error}

    def _write(self, pid: int, cpus: set[int]) -> None:
        """Every thread of `pid`; a thread that ends meanwhile is skipped."""
        try:
            tids = [int(tid) for tid in os.listdir(self._tasks.format(pid=pid))]
        except OSError as exc:
            self.error = f"engine {pid}: cannot list its threads: {exc.strerror}"
            return
        self.error = None
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                continue  # the thread ended
            except OSError as exc:
                self.error = f"engine {pid} thread {tid}: sched_setaffinity: {exc.strerror}"
                self._log.warning("affinity_refused", pid=pid, tid=tid, error=exc.strerror)
                return
        self._log.info("affinity", pid=pid, cpus=sorted(cpus))
