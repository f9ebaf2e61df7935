"""The worker thread: it alone owns the model, runs one generation at a time and applies config changes between
tokens (live: threads, rate cap; reload: model, context, KV type, continuing the same answer in the new context).

The event loop talks to it through `submit` / `configure` / `pause` / `cancel`; it answers through each job's `Sink`
(called on this thread). Its collaborators, each with its own state: `Slot` (the model in memory), `Reconfig` (the
settings in force, changes between tokens), `Pause` (the memory pause), `JobQueue` (the requests waiting, grouped by
adapter) and `Generation` (one answer, token by token, paced). ctypes drops the GIL during
llama.cpp calls, so the loop keeps serving while a token is computed.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping

import structlog

from governor.engine.adapters import AdapterPool
from governor.engine.adapterspec import AdapterSpec
from governor.engine.config import ConfigRefused, ModelSpec
from governor.engine.events import Ended, Failed, Last, stopping
from governor.engine.extra_buffers import ExtraBuffers
from governor.engine.generation import Generation
from governor.engine.jobqueue import JobQueue
from governor.engine.jobs import ConfigJob, Counters, Job, usage
from governor.engine.model import LoadedModel, ModelLoadError, extra_buffers_for
from governor.engine.pause import Pause
from governor.engine.reconfig import Reconfig
from governor.engine.slot import Slot
from governor.engine.window import ContextShift
from policies.decision import EngineConfig

log = structlog.get_logger("governor.engine")


class Worker:
    def __init__(
        self,
        models: dict[str, ModelSpec],
        settings: EngineConfig,
        extra_buffers: ExtraBuffers | None = None,
        *,
        keep_alive_s: float | None = None,
        context_shift: ContextShift = "on",
        adapters: Mapping[str, AdapterSpec] | None = None,
    ) -> None:
        self.models = models
        self.context_shift = context_shift
        self.extra_buffers = extra_buffers or extra_buffers_for()
        self.adapters = dict(adapters or {})  # the ladder's LoRA adapters (governor.engine.adapters; the pool's)
        pool = AdapterPool(self.adapters, settings.lora_pool_mib)
        self.slot = Slot(keep_alive_s, extra_buffers=self.extra_buffers.enabled, pool=pool)
        # Loaded here, so that a model that cannot be loaded is an error at start; warmed up on the worker thread
        # (see `_loop`) before the engine serves: a crash there still happens before it answers (a load crash).
        self.slot.load(models[settings.model], settings, why="start", warm=False)
        self.warm = threading.Event()  # the first decode has run (on the worker thread)
        self.counters = Counters()
        self.busy = False
        self.jobs = JobQueue(self.adapters)
        self._wake = threading.Event()  # cuts a rate-cap wait (and a pause) short
        self._stopping = False
        self.reconfig = Reconfig(
            settings,
            models,
            self.slot,
            self.counters,
            self.extra_buffers,
            on_change=self._changed,
            context=self._context,
        )
        self._pause = Pause(
            self.reconfig, self.slot, self._wake, stopping=lambda: self._stopping, on_change=self._changed
        )
        self.generation = Generation(
            self.reconfig, self._pause, self.slot, self.jobs, self.counters,
            wake=self._wake, context_shift=context_shift, stopping=lambda: self._stopping,
        )  # fmt: skip
        self._running: Job | None = None
        self.on_change: Callable[[], None] = _nothing  # busy flipped or settings changed (on this thread)
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)

    @property
    def settings(self) -> EngineConfig:
        """The settings in force (what status shows and a partial change merges into)."""
        return self.reconfig.settings

    @property
    def paused(self) -> str | None:
        """Why the model is held unloaded (the daemon's memory wait); None: it runs."""
        return self._pause.reason

    @property
    def model(self) -> LoadedModel:
        return self.reconfig.model

    @property
    def waiting(self) -> int:
        """Requests queued, not yet started."""
        return self.jobs.waiting

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.generation.decode_tokens_per_s

    @property
    def generation_s(self) -> float | None:
        """How long the last answer took (for Retry-After)."""
        return self.generation.generation_s

    def _context(self) -> str:
        return self.generation.context()  # built after the Reconfig that asks

    def _changed(self) -> None:
        self.on_change()

    # --- called from the event loop ---

    def start(self) -> None:
        self._thread.start()

    def load(self) -> int:
        """Requests in the engine: the running one (if any) plus those waiting."""
        return self.waiting + (1 if self.busy else 0)

    def submit(self, job: Job) -> None:
        if self._stopping:
            job.sink(stopping())
            return
        self.jobs.put(job)

    def configure(self, cj: ConfigJob) -> None:
        if self._stopping:
            cj.fail(ConfigRefused("the engine is shutting down", param=None, code="engine_stopping", status=503))
            return
        cj.tokens_at = self.counters.tokens_generated_total
        self.reconfig.add(cj)
        self._wake.set()
        self._interrupt_prefill()
        self.jobs.wake()

    def pause(self, reason: str | None) -> None:
        """Unload the model and keep it unloaded, saying why (`reason`: the daemon's "no tier fits in N MiB; waiting
        for memory"): a running answer stops at its next token boundary (a prefill is interrupted) and waits with its
        stream open, nothing sent; queued and new requests wait. None: load again and continue the answer where it
        stopped (its context evaluated again, as after a reload); an idle engine loads at its next request."""
        if self._stopping or reason == self.paused:
            return
        self._pause.reason = reason
        log.info("engine.pause" if reason is not None else "engine.resume", reason=reason)
        self._wake.set()
        self._interrupt_prefill()
        self.jobs.wake()
        self.on_change()

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        self._wake.set()
        if self._running is job:
            self._interrupt_prefill()

    def _interrupt_prefill(self) -> None:
        """A change, a cancel or a shutdown need not wait for a long prompt evaluation: stop it, then redo it
        (resuming from the last completed batch) or drop it."""
        run, m = self.generation.run, self.slot.current
        if run is not None and run.prefilling and m is not None:
            m.abort()

    def end_answers(self) -> None:
        """Shutting down: the running answer ends at the next token boundary (finish_reason "length", so its
        client gets a complete response), queued ones get a 503, and the thread exits."""
        self._stopping = True
        self._wake.set()
        self.jobs.wake()
        self._interrupt_prefill()

    def stop(self, timeout_s: float = 30.0) -> None:
        self.end_answers()
        self._thread.join(timeout_s)

    def tokens_per_s(self, window_s: float = 2.0) -> float:
        """Tokens delivered per second over the last `window_s` (governor.engine.pace)."""
        return self.generation.emits.tokens_per_s(window_s)

    # --- the worker thread ---

    def _loop(self) -> None:
        try:
            # Every llama.cpp computation of this process runs on this thread. With libgomp (llama-cpp-python's
            # build), each thread that computes gets its own OpenMP team whose threads stay; one more team than the
            # CPUs can hold puts libgomp in its throttled mode, where the decode threads sleep at every barrier of the
            # graph (~120 futex waits a token, a sixth of the decode speed) instead of spinning.
            self.model.warm_up()
            self.warm.set()
            while True:
                if self.paused is not None and not self._stopping:
                    self._pause.hold(None, None)  # requests wait in the queue
                    continue
                try:
                    job = self.jobs.get(self.slot.idle_wait(), self._adapter_in_use)
                except queue.Empty:  # idle for keep_alive_s: give the memory back
                    self.reconfig.apply(None)
                    if self.jobs.empty() and not self._stopping:
                        self.slot.unload(why="idle")
                    continue
                if self._stopping:
                    if job is not None:
                        job.sink(stopping())
                    break
                self.reconfig.apply(None)
                if job is None:
                    continue
                if job.cancelled.is_set():
                    self.counters.generations_cancelled += 1
                    job.sink(Ended("cancelled", usage(0, 0)))
                    continue
                self._serve(job)
                self.reconfig.apply(None)  # a change that came during the answer, or a warm swap still building
        except BaseException:
            # Only a model that can be neither rebuilt nor restored gets here: exit so that the daemon restarts us.
            log.exception("engine.worker_died")
            os._exit(70)
        finally:
            self._drain()
            self.slot.unload(why="stop")

    def _serve(self, job: Job) -> None:
        self.busy = True
        self._running = job
        self.on_change()
        final: Last
        try:
            final = self._ensure_loaded(job) or self.generation.answer(job)
        except Exception as exc:  # last resort: this job fails, the engine keeps serving
            log.exception("engine.generation_crashed")
            self.counters.generations_failed += 1
            final = Failed(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
        finally:
            self.busy = False
            self._running = self.generation.run = None
            self.slot.touch()
            self.on_change()
        job.sink(final)  # after `busy` is cleared: a client that has its answer sees an idle engine

    def _ensure_loaded(self, job: Job) -> Failed | None:
        """Load the model for a request after an idle unload or a pause; an error event when it cannot be loaded."""
        if self.slot.loaded:
            return None
        t0 = time.monotonic()
        try:
            self.slot.load(self.models[self.settings.model], self.settings, why="idle", warm=True)
        except ModelLoadError as exc:
            self.counters.generations_failed += 1
            return Failed(503, f"cannot load the model: {exc}", "model_load_failed")
        job.load_s = time.monotonic() - t0
        return None

    def _adapter_in_use(self) -> str | None:
        m = self.slot.current
        return None if m is None else m.adapter

    def _drain(self) -> None:
        for job in self.jobs.drain():
            job.sink(stopping())
        for cj in self.reconfig.drain():
            cj.fail(ConfigRefused("the engine is shutting down", param=None, code="engine_stopping", status=503))


def _nothing() -> None:
    pass
