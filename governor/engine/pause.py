"""The memory pause, applied by the worker thread: the daemon's "no tier fits in N MiB; waiting for memory" unloads the
model at the next token boundary while the answer keeps its place (its stream open, nothing sent) and requests wait in
the queue; on resume the model is loaded with the settings in force and the answer goes on, its context evaluated
again as after a reload (governor.engine.reconfig).

A part of `Worker` (governor.engine.worker), split out by topic: the worker's state it uses is declared below.
"""

from __future__ import annotations

import threading

import structlog

from governor.engine.jobs import Job, Run
from governor.engine.reconfig import Reconfigure

log = structlog.get_logger("governor.engine")


class Pausing(Reconfigure):
    paused: str | None  # why the model must stay unloaded; None: run
    _wake: threading.Event
    _stopping: bool

    def _hold(self, run: Run | None, job: Job | None) -> None:
        """Paused: unload the model (memory is what the device lacks now) and wait, applying config changes to the
        settings the next load uses, until resumed, `job` is cancelled or the engine stops. A running answer keeps
        its tokens: `_pause_point` evaluates them again in the new context and the stream goes on."""
        if run is not None and run.gen is not None:
            run.gen.close()
            run.gen = None
        if self._swap is not None:  # a warm swap's second context is memory too: its change waits for the next load
            swap, self._swap = self._swap, None
            swap.cancel()
            log.info("engine.swap_cancelled", why="paused", **swap.target.model_dump())
            with self._lock:
                self._pending.insert(0, swap.job)
        if self.slot.loaded:
            self.slot.unload(why="paused")
            log.info("engine.paused", reason=self.paused, mid_answer=run is not None)
            self.on_change()
        while self.paused is not None and not self._stopping and not (job is not None and job.cancelled.is_set()):
            if self._pending:
                self._apply_pending(None)  # unloaded: recorded for the next load
            self._wake.wait()
            self._wake.clear()
        if self._pending:
            self._apply_pending(None)

    def _pause_point(self, run: Run) -> bool:
        """At a token boundary of `run`: hold while paused; once resumed, load the model with the settings in force
        and continue `run` there (raises ModelLoadError: the answer fails, the engine keeps serving). True when the
        decode loop must look again (a cancel, a stop or the end of the answer may have come meanwhile)."""
        if self.paused is not None:
            self._hold(run, run.job)
            return True
        if self.slot.loaded:
            return False
        self.slot.load(self.models[self.settings.model], self.settings, why="resume", warm=False)
        log.info("engine.resumed", model=self.settings.model, tokens=len(run.ctx_tokens))
        self._resume(run)
        self.on_change()
        return True
