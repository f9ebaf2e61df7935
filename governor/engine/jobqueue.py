"""The requests waiting for the engine's worker, in arrival order, grouped by LoRA adapter.

A request whose adapter is the one in use may overtake one that needs another (one switch saved), at most
GROUP_SKIPS times for any request overtaken. A request's adapter file is read ahead into the page cache when it
comes, and the worker loads the adapter the next queued request needs between two tokens of the running answer
(`prefetch`, `next_adapter`). A `None` in the queue only wakes the worker (a change, a pause, a shutdown).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping

from governor.engine.adapters import readahead
from governor.engine.adapterspec import AdapterSpec
from governor.engine.jobs import Job

GROUP_SKIPS = 3  # how many times a waiting request may be overtaken by ones whose adapter is already in use


class JobQueue:
    def __init__(self, adapters: Mapping[str, AdapterSpec]) -> None:
        self._adapters = adapters
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0  # jobs queued, not yet started
        self.prefetch = False  # a queued request needs an adapter the pool may not hold: load it between tokens

    def put(self, job: Job) -> None:
        with self._lock:
            self.waiting += 1
        if job.adapter is not None and job.adapter in self._adapters:
            readahead(self._adapters[job.adapter].path)  # into the page cache now; loaded between tokens
            self.prefetch = True
        self._jobs.put(job)

    def wake(self) -> None:
        """Wake an idle worker (a spurious wake-up when it is busy is harmless)."""
        self._jobs.put(None)

    def empty(self) -> bool:
        return self._jobs.empty()

    def get(self, timeout: float | None, active: Callable[[], str | None]) -> Job | None:
        """The next job to serve (None: a wake-up), waiting at most `timeout` (then queue.Empty). `active`: the
        adapter in use now."""
        job = self._jobs.get(timeout=timeout)
        if job is not None:
            job = self._regroup(job, active())
            with self._lock:
                self.waiting -= 1
        return job

    def _regroup(self, job: Job, active: str | None) -> Job:
        """`job` (the oldest), unless it needs another adapter than the one in use and a later job needs that one:
        then the later job goes first (one switch saved), at most GROUP_SKIPS times for any job overtaken."""
        if job.adapter == active or job.skipped >= GROUP_SKIPS:
            return job
        with self._jobs.mutex:
            queued: deque[Job | None] = self._jobs.queue
            for i, other in enumerate(queued):
                if other is not None and other.adapter == active and not other.cancelled.is_set():
                    del queued[i]
                    queued.appendleft(job)  # back where it was: first in line
                    for before in [job, *list(queued)[1 : i + 1]]:
                        if before is not None:
                            before.skipped += 1
                    return other
        return job

    def next_adapter(self) -> str | None:
        """The adapter the first queued request that asks for one needs."""
        with self._jobs.mutex:
            return next((j.adapter for j in self._jobs.queue if j is not None and j.adapter is not None), None)

    def drain(self) -> list[Job]:
        """Every job still queued, taken out (the worker is stopping)."""
        out: list[Job] = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return out
            if job is not None:
                out.append(job)
