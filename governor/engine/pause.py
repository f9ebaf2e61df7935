"""The memory pause, applied on the worker thread: the daemon's "no tier fits in N MiB; waiting for memory" unloads the
model at the next token boundary while the answer keeps its place (its stream open, nothing sent) and requests wait in
the queue; on resume the model is loaded with the settings in force and the answer goes on, its context evaluated
again as after a reload (governor.engine.reconfig).

`Pause` owns the reason; the worker (governor.engine.worker) sets it and calls it at token boundaries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from governor.engine.jobs import Job, Run
from governor.engine.reconfig import Reconfig
from governor.engine.slot import Slot

log = structlog.get_logger("governor.engine")


class Pause:
    def __init__(
        self,
        reconfig: Reconfig,
        slot: Slot,
        wake: threading.Event,
        *,
        stopping: Callable[[], bool],
        on_change: Callable[[], None],
    ) -> None:
        """`wake` is set when the reason changes, a change or a cancel comes; `stopping()`: the engine shuts down."""
        self.reconfig, self.slot, self._wake = reconfig, slot, wake
        self._stopping, self._on_change = stopping, on_change
        self.reason: str | None = None  # why the model must stay unloaded; None: run

    def hold(self, run: Run | None, job: Job | None) -> None:
        """Paused: unload the model (memory is what the device lacks now) and wait, applying config changes to the
        settings the next load uses, until resumed, `job` is cancelled or the engine stops. A running answer keeps
        its tokens: `point` evaluates them again in the new context and the stream goes on."""
        if run is not None and run.gen is not None:
            run.gen.close()
            run.gen = None
        self.reconfig.set_aside()  # a warm build's second context is memory too
        if self.slot.loaded:
            self.slot.unload(why="paused")
            log.info("engine.paused", reason=self.reason, mid_answer=run is not None)
            self._on_change()
        while self.reason is not None and not self._stopping() and not (job is not None and job.cancelled.is_set()):
            if self.reconfig.waiting:
                self.reconfig.apply(None)  # unloaded: recorded for the next load
            self._wake.wait()
            self._wake.clear()
        if self.reconfig.waiting:
            self.reconfig.apply(None)

    def point(self, run: Run) -> bool:
        """At a token boundary of `run`: hold while paused; once resumed, load the model with the settings in force
        and continue `run` there (raises ModelLoadError: the answer fails, the engine keeps serving). True when the
        decode loop must look again (a cancel, a stop or the end of the answer may have come meanwhile)."""
        if self.reason is not None:
            self.hold(run, run.job)
            return True
        if self.slot.loaded:
            return False
        settings = self.reconfig.settings
        self.slot.load(self.reconfig.models[settings.model], settings, why="resume", warm=False)
        log.info("engine.resumed", model=settings.model, tokens=len(run.ctx_tokens))
        self.reconfig.resume(run)
        self._on_change()
        return True
