"""The worker thread: it alone owns the model, runs one generation at a time and applies config changes between
tokens (live: threads, rate cap; reload: model, context, KV type, continuing the same answer in the new context).

The event loop talks to it through `submit` / `configure` / `pause` / `cancel`; it answers through each job's `Sink`
(called on this thread). Its collaborators, each with its own state: `Slot` (the model in memory), `Reconfig` (the
settings in force, changes between tokens), `Pause` (the memory pause), `Emits` (the pace). ctypes drops the GIL during
llama.cpp calls, so the loop keeps serving while a token is computed.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

import structlog

from governor.engine.adapters import AdapterPool, readahead
from governor.engine.adapterspec import AdapterError, AdapterSpec
from governor.engine.config import ConfigRefused, ModelSpec
from governor.engine.events import Ended, Failed, Last, Started, Text, stopping
from governor.engine.extra_buffers import ExtraBuffers
from governor.engine.jobs import ConfigJob, Counters, Job, Run, usage
from governor.engine.model import LoadedModel, ModelLoadError, extra_buffers_for
from governor.engine.pace import Emits, ewma
from governor.engine.pause import Pause
from governor.engine.prompts import prepare
from governor.engine.reconfig import Reconfig
from governor.engine.slot import Slot
from governor.engine.window import ContextShift, context_mode
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
        self.waiting = 0  # jobs queued, not yet started
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._wake = threading.Event()  # cuts a rate-cap wait (and a pause) short
        self._prefetch = False  # a queued request needs an adapter the pool may not hold: load it between tokens
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
        self._emits = Emits()  # when tokens left: the rate cap's pace and the delivered rate
        self._run: Run | None = None  # the generation in progress (read by the loop thread to interrupt it)
        self._running: Job | None = None
        self.decode_tokens_per_s: float | None = None
        self.generation_s: float | None = None  # recent generation length, for Retry-After
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
        with self._lock:
            self.waiting += 1
        if job.adapter is not None and job.adapter in self.adapters:
            readahead(self.adapters[job.adapter].path)  # into the page cache now; loaded between tokens (_decode)
            self._prefetch = True
        self._jobs.put(job)

    def configure(self, cj: ConfigJob) -> None:
        if self._stopping:
            cj.fail(ConfigRefused("the engine is shutting down", param=None, code="engine_stopping", status=503))
            return
        cj.tokens_at = self.counters.tokens_generated_total
        self.reconfig.add(cj)
        self._wake.set()
        self._interrupt_prefill()
        self._jobs.put(None)  # wakes an idle worker (a spurious wake-up when busy is harmless)

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
        self._jobs.put(None)
        self.on_change()

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        self._wake.set()
        if self._running is job:
            self._interrupt_prefill()

    def _interrupt_prefill(self) -> None:
        """A change, a cancel or a shutdown need not wait for a long prompt evaluation: stop it, then redo it
        (resuming from the last completed batch) or drop it."""
        run, m = self._run, self.slot.current
        if run is not None and run.prefilling and m is not None:
            m.abort()

    def end_answers(self) -> None:
        """Shutting down: the running answer ends at the next token boundary (finish_reason "length", so its
        client gets a complete response), queued ones get a 503, and the thread exits."""
        self._stopping = True
        self._wake.set()
        self._jobs.put(None)
        self._interrupt_prefill()

    def stop(self, timeout_s: float = 30.0) -> None:
        self.end_answers()
        self._thread.join(timeout_s)

    def tokens_per_s(self, window_s: float = 2.0) -> float:
        """Tokens delivered per second over the last `window_s` (governor.engine.pace)."""
        return self._emits.tokens_per_s(window_s)

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
                    job = self._jobs.get(timeout=self.slot.idle_wait())
                except queue.Empty:  # idle for keep_alive_s: give the memory back
                    self.reconfig.apply(None)
                    if self._jobs.empty() and not self._stopping:
                        self.slot.unload(why="idle")
                    continue
                if job is not None:
                    job = self._regroup(job)
                    with self._lock:
                        self.waiting -= 1
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
            final = self._ensure_loaded(job) or self._generate(job)
        except Exception as exc:  # last resort: this job fails, the engine keeps serving
            log.exception("engine.generation_crashed")
            self.counters.generations_failed += 1
            final = Failed(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
        finally:
            self.busy = False
            self._running = self._run = None
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

    def _drain(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.sink(stopping())
        for cj in self.reconfig.drain():
            cj.fail(ConfigRefused("the engine is shutting down", param=None, code="engine_stopping", status=503))

    def _generate(self, job: Job) -> Last:
        """Runs one answer, sending its events; returns the last one (Ended or Failed) for the caller to send."""
        req, m = job.request, self.model
        try:  # before the prompt meets the cache: the cache belongs to the adapter that computed it
            self.slot.pool.use(m, job.adapter)
        except AdapterError as exc:
            self.counters.generations_failed += 1
            return Failed(exc.status, exc.message, exc.code)
        run = prepare(self.model, job, chunked=self.context_shift != "off")
        if not isinstance(run, Run):
            self.counters.generations_failed += 1
            return run
        run.answer_from = run.n_prompt
        run.model_name = m.label
        if self._context() == "shift":
            run.shifted = m.reuse(run.ctx_tokens)
            if run.shifted:
                self.counters.context_shifts_total += 1
                self.counters.shifted_tokens_total += run.shifted
        if run.trimmed:
            self.reconfig.log_trim(run, "request", run.trimmed)
        self.counters.prompt_tokens_total += run.n_prompt
        run.evaluated_from = m.evaluated
        job.sink(Started(m.label, run.n_prompt, run.trimmed))
        started = time.monotonic()
        try:
            run.gen = m.generate(run.ctx_tokens, req.sampling(), req.seed, grammar=job.constraint.grammar)
            self._run = run
            self._decode(run)
        except (RuntimeError, ValueError) as exc:  # llama.cpp decode failures surface as these
            log.error("engine.generation_failed", error=str(exc))
            self.counters.generations_failed += 1
            return Failed(500, f"generation failed: {exc}", "generation_failed")
        except ModelLoadError as exc:  # resuming after a pause
            self.counters.generations_failed += 1
            return Failed(503, f"cannot load the model: {exc}", "model_load_failed")
        finally:
            if run.gen is not None:
                run.gen.close()
        self.generation_s = time.monotonic() - started
        log.info(
            "engine.answer",
            finish=run.finish,
            prompt_tokens=run.n_prompt,
            completion_tokens=run.n_completion,
            seconds=round(self.generation_s, 3),
            model=run.model_name,
            trimmed_messages=run.trimmed,
        )
        tail = run.text.flush()
        if tail:
            job.sink(Text(tail))
        if run.finish == "cancelled":
            self.counters.generations_cancelled += 1
        else:
            self.counters.generations_completed += 1
        info = {
            "context": self._context(),
            "shifted_tokens": run.shifted,
            "prompt_tokens_evaluated": run.prompt_evaluated,
            "decode_tokens_per_s": run.decode_tokens_per_s(),
        }
        assert run.finish is not None  # _decode returns only once it is set
        return Ended(run.finish, usage(run.n_prompt, run.n_completion), info)

    def _context(self) -> str:
        """How a chat that outgrew the context is handled now (governor.engine.window.context_mode)."""
        return context_mode(self.context_shift, self.slot.current is not None and self.slot.current.can_shift)

    def _decode(self, run: Run) -> None:
        job, limit = run.job, run.job.request.token_limit()
        while True:
            if self.reconfig.due or self._prefetch:
                self._between_tokens(run)
            if run.finish is not None:
                return
            if job.cancelled.is_set() or self._stopping:
                run.finish = "cancelled" if job.cancelled.is_set() else "length"
                return
            if self._pause.point(run):
                continue
            m = self.model
            if (limit is not None and run.n_completion >= limit) or len(run.ctx_tokens) >= m.n_ctx:
                run.finish = "length"
                return
            if run.gen is None:  # after a reload, or a prefill that was interrupted
                run.gen = self.reconfig.generator(run)
                run.prefilling = True
            t0 = time.perf_counter()
            try:
                if run.prefilling:
                    with m.interruptible():
                        token = next(run.gen)
                    self._prefilled(run, m)
                else:
                    token = next(run.gen)
            except StopIteration:
                run.finish = "stop"
                return
            except RuntimeError:
                if not m.abort_requested:
                    raise
                run.gen = None  # what to do next (cancel, stop, apply a change) is decided at the top of the loop
                continue
            t1 = time.perf_counter()
            if run.n_completion:  # the first call also evaluated the prompt
                self.decode_tokens_per_s = ewma(self.decode_tokens_per_s, t1 - t0)
                run.decoded_one(t1 - t0)
            eog, data = m.token(token)
            # With a grammar, an end token means the output is complete (the grammar allows nothing else then).
            if eog and (not job.request.ignore_eos or job.constraint.grammar is not None):
                run.finish = "stop"
                return
            run.ctx_tokens.append(token)
            run.n_completion += 1
            self.counters.tokens_generated_total += 1
            run.answer += data
            text = run.text.push(data)
            if self.settings.max_tokens_per_s is not None:
                self._pace(run)
            if text:
                job.sink(Text(text))
            self._emits.mark()
            if run.text.stopped:
                run.finish = "stop"
                return

    def _prefilled(self, run: Run, m: LoadedModel) -> None:
        run.prefilling = False
        if run.prompt_evaluated is None:  # the answer's first prefill (not one after a reload or a pause)
            run.prompt_evaluated = m.evaluated - run.evaluated_from
            self.counters.prompt_tokens_evaluated_total += run.prompt_evaluated

    def _pace(self, run: Run) -> None:
        """Hold the token until 1/cap after the previous one; a config change or cancel cuts the wait short."""
        while True:
            cap = self.settings.max_tokens_per_s
            if cap is None or run.job.cancelled.is_set() or self._stopping or self.paused:
                return
            wait = self._emits.wait_s(cap)
            if wait <= 0:
                return
            self._wake.wait(wait)
            self._wake.clear()
            if self.reconfig.waiting:
                self.reconfig.apply(run)

    # --- LoRA adapters: grouping the queue, loading ahead (governor.engine.adapters) ---

    def _regroup(self, job: Job) -> Job:
        """The next job to serve: `job` (the oldest), unless it needs another adapter than the one in use and a
        later job needs that one: then the later job goes first (one switch saved), at most GROUP_SKIPS times
        for any job overtaken."""
        m = self.slot.current
        active = None if m is None else m.adapter
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

    def _between_tokens(self, run: Run) -> None:
        if self._prefetch:
            self._prefetch_queued()
        if self.reconfig.due:
            self.reconfig.apply(run)

    def _prefetch_queued(self) -> None:
        """Between two tokens: load the adapter the next queued request needs, if the pool has room for it
        without the adapter this answer runs on (its file was read ahead when the request came)."""
        self._prefetch = False
        m = self.slot.current
        if m is None:
            return
        with self._jobs.mutex:
            wanted = next((j.adapter for j in self._jobs.queue if j is not None and j.adapter is not None), None)
        if wanted is not None and wanted not in m.adapters and self.slot.pool.prefetch(m, wanted):
            log.info("engine.adapter_prefetched", adapter=wanted)


GROUP_SKIPS = 3  # how many times a waiting request may be overtaken by ones whose adapter is already in use


def _nothing() -> None:
    pass
