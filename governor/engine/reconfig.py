"""Configuration changes, applied on the worker thread between tokens: live (threads, rate cap), or a rebuilt context
(model, context, KV type, n_batch) that continues the same answer — copied, built warm beside it, or cold, as the
reconfiguration plan says (governor.engine.plan).

`Reconfig` owns the engine's settings in force, the changes waiting for a token boundary and a warm build in
progress; the worker (governor.engine.worker) hands it changes and calls it at token boundaries.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from governor.engine.config import ConfigRefused, ModelSpec
from governor.engine.events import ModelChanged, Trimmed
from governor.engine.extra_buffers import ExtraBuffers
from governor.engine.jobs import ConfigJob, Counters, Run
from governor.engine.model import LoadedModel, ModelLoadError, SavedSequence
from governor.engine.plan import answer_room, kind
from governor.engine.prompts import refit
from governor.engine.slot import Slot
from governor.engine.swap import WarmSwap, cold_reason
from policies.decision import EngineConfig

log = structlog.get_logger("governor.engine")


class Reconfig:
    def __init__(
        self,
        settings: EngineConfig,
        models: dict[str, ModelSpec],
        slot: Slot,
        counters: Counters,
        extra_buffers: ExtraBuffers,
        *,
        on_change: Callable[[], None],
        context: Callable[[], str],
    ) -> None:
        """`on_change`: the settings changed (the status feed); `context()`: how an outgrown chat is handled now."""
        self.settings = settings
        self.models, self.slot, self.counters, self.extra_buffers = models, slot, counters, extra_buffers
        self._on_change, self._context = on_change, context
        self._lock = threading.Lock()
        self._pending: list[ConfigJob] = []  # changes waiting for the next token boundary (added by the event loop)
        self._swap: WarmSwap | None = None  # a KV type change being built beside the answering context

    @property
    def model(self) -> LoadedModel:
        """The loaded model; only called where one is (while answering, or after a load)."""
        assert self.slot.current is not None
        return self.slot.current

    def add(self, cj: ConfigJob) -> None:
        """From the event loop: applied at the next token boundary (`due`)."""
        with self._lock:
            self._pending.append(cj)

    @property
    def waiting(self) -> bool:
        """Changes wait to be applied."""
        return bool(self._pending)

    @property
    def due(self) -> bool:
        """Something to do at this token boundary: a change waits, or the warm build is ready."""
        return bool(self._pending) or (self._swap is not None and self._swap.ready)

    def apply(self, run: Run | None) -> None:
        """Apply the waiting changes (`run`: the answer in progress, continued in a rebuilt context)."""
        with self._lock:
            pending, self._pending = self._pending, []
        # The warm swap is done, or must be: a newer change applies on top of it, and between answers it is the
        # conversation's cache (waiting for it, as a cold reload would have).
        if self._swap is not None and (self._swap.ready or pending or run is None):
            self._finish_swap(run)
        for cj in pending:
            t0 = time.perf_counter()
            cj.tokens_waited = self.counters.tokens_generated_total - cj.tokens_at
            target = cj.target
            if target.lora_pool_mib != self.settings.lora_pool_mib:  # live: evict down to the new budget now
                self.slot.pool.resize(self.slot.current, target.lora_pool_mib, answering=run is not None)
            if not self.slot.loaded:  # the next load uses them
                self.settings = target
                cj.done(target, "unloaded", time.perf_counter() - t0)
                log.info("engine.config", applied="unloaded", **target.model_dump())
                continue
            if kind(self.settings, target) == "live":
                self.model.set_live(target)
                self.settings = target
                cj.done(target, "live", time.perf_counter() - t0)
                self._on_change()
                log.info("engine.config", applied="live", **target.model_dump())
                continue
            if run is not None and self._start_swap(target, run, cj):
                continue
            try:
                self._reload(target, run)
            except ModelLoadError as exc:
                cj.fail(ConfigRefused(str(exc), param=None, code="reload_failed", status=500))
                continue
            seconds = time.perf_counter() - t0
            self.counters.reloads_total += 1
            cj.done(target, "reload", seconds)
            self._on_change()
            log.info(
                "engine.config",
                applied="reload",
                seconds=round(seconds, 3),
                mid_answer=run is not None,
                **target.model_dump(),
            )

    def _reload(self, target: EngineConfig, run: Run | None) -> None:
        """Close the old model first (memory is what a device lacks), build the new one, re-evaluate the answer.

        When the new model cannot be built, the old settings are rebuilt and the answer continues there.
        """
        if run is not None and run.gen is not None:
            run.gen.close()
            run.gen = None
        previous = self.settings
        # Same model and KV type (an n_ctx change): the cache's contents can be copied into the new context.
        saved = self.model.save_sequence() if kind(previous, target) == "resize" else None
        self.slot.unload(why="config")
        try:
            self.slot.load(self.models[target.model], target, why="config", warm=run is None)
            self.settings = target
        except ModelLoadError:
            try:
                self.slot.load(self.models[previous.model], previous, why="config", warm=run is None)
            except ModelLoadError as exc:
                # No model at all (the old one is closed: touching it would crash): exit so the daemon restarts us.
                log.critical("engine.no_model", error=str(exc))
                os._exit(70)
            self._restore(saved)
            if run is not None:
                self.resume(run)
            raise
        self._restore(saved)
        if run is not None:
            self.resume(run)

    def _start_swap(self, target: EngineConfig, run: Run, cj: ConfigJob) -> bool:
        """Build `target` warm beside the answering context when it can be (governor.engine.swap)."""
        limit = run.job.request.token_limit()
        room = answer_room(target.n_ctx, None if limit is None else limit - run.n_completion)
        why = cold_reason(self.model, self.settings, target, len(run.ctx_tokens), room)
        if why is not None:
            log.info("engine.swap_cold", why=why)
            return False
        half = self.model.threads // 2
        self._swap = WarmSwap(
            self.models[target.model],
            target,
            run.ctx_tokens,
            threads=half,
            extra_buffers=self.extra_buffers.enabled,
            job=cj,
            adapter=None if self.model.adapter is None else self.slot.pool.specs[self.model.adapter],
        )
        self.model.set_threads(self.model.threads - half)
        return True

    def _finish_swap(self, run: Run | None) -> None:
        """Switch to the context the swap built (waiting for it), or stay on the old one when the build failed."""
        swap, self._swap = self._swap, None
        assert swap is not None
        built = swap.take()
        if built is None:
            self.model.set_threads(self.settings.threads)
            swap.job.fail(ConfigRefused(f"cannot build it: {swap.error}", param=None, code="reload_failed", status=500))
            return
        if run is not None and run.gen is not None:
            run.gen.close()
            run.gen = None
        self.slot.replace(built)
        built.set_threads(swap.target.threads)
        self.settings = swap.target
        self.counters.reloads_total += 1
        self.counters.warm_swaps_total += 1
        if run is not None:
            self.resume(run)  # the cache holds the answer up to the swap's start: the rest is evaluated
        seconds = time.perf_counter() - swap.started
        swap.job.tokens_waited = self.counters.tokens_generated_total - swap.job.tokens_at  # answered meanwhile
        swap.job.done(swap.target, "reload", seconds)
        self._on_change()
        log.info("engine.config", applied="reload", warm=True, seconds=round(seconds, 3), **swap.target.model_dump())

    def _restore(self, saved: SavedSequence | None) -> None:
        if saved is None:
            return
        kept = self.model.restore_sequence(saved)
        if kept:
            self.counters.cache_copies_total += 1
        log.info("engine.cache_copied" if kept else "engine.cache_not_copied", tokens=len(saved.tokens))

    def resume(self, run: Run) -> None:
        """Continue `run` in the new context: the same tokens when they fit, else a re-rendered, trimmed prompt."""
        m, req = self.model, run.job.request
        limit = req.token_limit()
        room = answer_room(m.n_ctx, None if limit is None else limit - run.n_completion)
        if run.model_name != m.label or len(run.ctx_tokens) + room > m.n_ctx:
            trimmed = run.trimmed
            if not refit(m, run, room):
                run.finish = "length"  # not even the last message and the answer so far fit: end the answer there
                return
            if run.trimmed > trimmed:
                self.log_trim(run, "reconfig", run.trimmed - trimmed)
                run.job.sink(Trimmed(run.trimmed))
        if run.model_name != m.label:  # another tier, or the answer's adapter did not fit the new one
            run.model_name = m.label
            run.job.sink(ModelChanged(m.label))
        # The decode loop evaluates what the cache lacks (all of it, or after a cache copy only the last token), as
        # an interruptible prefill: a newer change, a cancel or a shutdown stops it between batches.
        run.gen = None
        run.prefilling = True

    def generator(self, run: Run) -> Any:
        """A generator that continues `run`: its grammar state is replayed from the answer's tokens so far."""
        req = run.job.request
        replay = run.ctx_tokens[run.answer_from :]
        return self.model.generate(
            run.ctx_tokens, req.sampling(), req.seed, grammar=run.job.constraint.grammar, replay=replay
        )

    def log_trim(self, run: Run, when: str, delta: int) -> None:
        self.counters.trimmed_messages_total += delta
        log.info(
            "engine.trimmed",
            when=when,
            trimmed_messages=run.trimmed,
            kept=len(run.messages or ()) - run.trimmed,
            n_ctx=self.model.n_ctx,
            context=self._context(),
            shifted_tokens=run.shifted,
        )

    def set_aside(self) -> None:
        """Memory is needed now (a pause): a warm build's second context goes, its change waits for the next load."""
        if self._swap is None:
            return
        swap, self._swap = self._swap, None
        swap.cancel()
        log.info("engine.swap_cancelled", why="paused", **swap.target.model_dump())
        with self._lock:
            self._pending.insert(0, swap.job)

    def drain(self) -> list[ConfigJob]:
        """Shutting down: every change not applied (a warm build cancelled), for the caller to refuse."""
        with self._lock:
            pending, self._pending = self._pending, []
        if self._swap is not None:
            self._swap.cancel()
            pending.append(self._swap.job)
            self._swap = None
        return pending
