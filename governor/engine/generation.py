"""One answer on the engine's worker thread, token by token: the prompt prepared and evaluated (the cache reused
or shifted), then each token decoded, paced by the rate cap and sent, with the collaborators' work between two tokens:
a config change (`Reconfig`), the memory pause (`Pause`), loading the adapter a queued request needs (`JobQueue`).
The answer ends on a stop, the length, a cancel or shutdown, and its last event (`Ended` or `Failed`) is returned.
The worker (governor.engine.worker) owns the thread and the queue; this is what it runs for each request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from governor.engine.adapterspec import AdapterError
from governor.engine.events import Ended, Failed, Last, Started, Text
from governor.engine.jobqueue import JobQueue
from governor.engine.jobs import Counters, Job, Run, usage
from governor.engine.model import LoadedModel, ModelLoadError
from governor.engine.pace import Emits, ewma
from governor.engine.pause import Pause
from governor.engine.prompts import prepare
from governor.engine.reconfig import Reconfig
from governor.engine.slot import Slot
from governor.engine.window import ContextShift, context_mode
from policies.decision import EngineConfig

log = structlog.get_logger("governor.engine")


class Generation:
    def __init__(
        self, reconfig: Reconfig, pause: Pause, slot: Slot, jobs: JobQueue, counters: Counters, *,
        wake: threading.Event, context_shift: ContextShift, stopping: Callable[[], bool],
    ) -> None:  # fmt: skip
        self.reconfig = reconfig
        self._pause = pause
        self.slot = slot
        self.jobs = jobs
        self.counters = counters
        self._wake = wake  # set when a rate-cap wait should end early (a change, a cancel)
        self.context_shift = context_shift
        self._stopping = stopping
        self.emits = Emits()  # when tokens left: the rate cap's pace and the delivered rate
        self.run: Run | None = None  # the answer in progress (read by the loop thread to interrupt its prefill)
        self.decode_tokens_per_s: float | None = None
        self.generation_s: float | None = None  # recent generation length, for Retry-After

    @property
    def settings(self) -> EngineConfig:
        return self.reconfig.settings

    @property
    def model(self) -> LoadedModel:
        return self.reconfig.model

    def answer(self, job: Job) -> Last:
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
        if self.context() == "shift":
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
            self.run = run
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
            "context": self.context(),
            "shifted_tokens": run.shifted,
            "prompt_tokens_evaluated": run.prompt_evaluated,
            "decode_tokens_per_s": run.decode_tokens_per_s(),
        }
        assert run.finish is not None  # _decode returns only once it is set
        return Ended(run.finish, usage(run.n_prompt, run.n_completion), info)

    def context(self) -> str:
        """How a chat that outgrew the context is handled now (governor.engine.window.context_mode)."""
        return context_mode(self.context_shift, self.slot.current is not None and self.slot.current.can_shift)

    def _decode(self, run: Run) -> None:
        job, limit = run.job, run.job.request.token_limit()
        while True:
            if self.reconfig.due or self.jobs.prefetch:
                self._between_tokens(run)
            if run.finish is not None:
                return
            if job.cancelled.is_set() or self._stopping():
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
            self.emits.mark()
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
            if cap is None or run.job.cancelled.is_set() or self._stopping() or self._pause.reason:
                return
            wait = self.emits.wait_s(cap)
            if wait <= 0:
                return
            self._wake.wait(wait)
            self._wake.clear()
            if self.reconfig.waiting:
                self.reconfig.apply(run)

    def _between_tokens(self, run: Run) -> None:
        if self.jobs.prefetch:
            self._prefetch_queued()
        if self.reconfig.due:
            self.reconfig.apply(run)

    def _prefetch_queued(self) -> None:
        """Between two tokens: load the adapter the next queued request needs, if the pool has room for it
        without the adapter this answer runs on (its file was read ahead when the request came)."""
        self.jobs.prefetch = False
        m = self.slot.current
        if m is None:
            return
        wanted = self.jobs.next_adapter()
        if wanted is not None and wanted not in m.adapters and self.slot.pool.prefetch(m, wanted):
            log.info("engine.adapter_prefetched", adapter=wanted)
