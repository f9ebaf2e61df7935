"""The simulated engine's warm swap: a KV type change mid-answer built beside the answering context, as the real
engine does it (governor.engine.swap, docs/engine.md "A KV-type change mid-answer, warm").

Warm when the change keeps the model, the engine runs two threads or more, the answer so far plus room for the rest
fits the new context, and the memory available as the world sees it (room left by other programs minus the engine's
resident memory) minus the new KV cache and compute buffer leaves the policy's default reserve. The new context is
built (`context_s`), then half of the threads evaluate the answer's tokens in it while the answer goes on with the
other half; then a few catch-up rounds evaluate the tokens that came meanwhile, and the engine switches.

`Swapping` is a part of `EngineSim` (governor.lab.engine), split out by topic as the real engine's worker is: the
engine's state it uses is declared there; its step loop runs the swap's prefill beside the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from governor.engine.chat import room_for_answer
from governor.lab.device import EngineSpec, SimModelSpec
from governor.lab.workload import Request
from policies.decision import EngineConfig
from policies.memfit import MIB, ModelFootprint
from policies.schema import Memory

if TYPE_CHECKING:
    from governor.lab.engine import EngineStats

RESERVE_BYTES = Memory().reserve_mb * MIB  # what the real engine leaves free (governor.engine.swap.RESERVE_BYTES)
CATCH_UP_ROUNDS = 4  # evaluations of the tokens the answer gained meanwhile (governor.engine.swap.CATCH_UP_ROUNDS)


def extra_bytes(footprint: ModelFootprint, target: EngineConfig) -> float:
    """What the second context adds: its KV cache and compute buffer. The weights are the mapped file, shared (the
    lab models no repacked copy; the real engine adds one where llama.cpp made it)."""
    return footprint.kv_bytes(target.n_ctx, target.kv_type) + footprint.compute_bytes(target.n_ctx, target.n_batch)


def why_cold(
    old: EngineConfig,
    target: EngineConfig,
    *,
    threads: int,
    tokens: float,
    answer_left: float,
    available: float,
    need: float,
) -> str | None:
    """None when `target` can be built warm beside `old` mid-answer (the answer's `tokens` so far, `answer_left` to
    come; `available` bytes, of which the new context takes `need`), else why not (governor.engine.swap.why_cold)."""
    if target.model != old.model or target.kv_type == old.kv_type:
        return "not a KV type change of the same model"
    if threads < 2:
        return "one thread: nothing to split"
    if tokens + room_for_answer(target.n_ctx, max(round(answer_left), 1)) > target.n_ctx:
        return "the answer does not fit the new context as it is"
    if available - need < RESERVE_BYTES:
        return f"{need / MIB:.0f} MiB more would leave less than {RESERVE_BYTES / MIB:.0f} MiB"
    return None


@dataclass
class WarmSwap:
    """The new context being built: ready at `ready_s`, then it evaluates the answer up to `goal` tokens."""

    target: EngineConfig
    extra_bytes: float  # its memory, on top of the answering context's
    threads: int  # building it; the answer goes on with the rest
    ready_s: float  # the context built (then the prefill starts)
    goal: float  # the answer's tokens it evaluates in this round (all but the last, which the switch evaluates)
    done: float = 0.0
    rounds: int = 1
    then: EngineConfig | None = None  # a newer change: the answer waits for the build, then it applies on top

    def until(self, now: float, rate: float) -> float:
        """Seconds to the swap's next event at `rate` prompt tokens/s: the context built, or this round done."""
        if now < self.ready_s:
            return self.ready_s - now
        return max(0.0, self.goal - self.done) / rate

    def due(self, now: float, tokens: float) -> bool:
        """Whether the engine switches now, the answer having `tokens`; starts a catch-up round when one is left and
        at least two tokens came meanwhile (as WarmSwap._build)."""
        if now < self.ready_s or self.done < self.goal - 1e-9:
            return False
        if self.rounds <= CATCH_UP_ROUNDS and tokens - 1 - self.done >= 2:
            self.goal = tokens - 1
            self.rounds += 1
            return False
        return True


class Swapping:
    """Starting, finishing and dropping a warm swap (a part of EngineSim)."""

    spec: EngineSpec
    tier: SimModelSpec | None
    stats: EngineStats
    current: Request | None
    stopped: bool
    loaded: bool
    ready_s: float
    room_bytes: float
    ctx: float
    prefill_left: float
    answer_left: float
    _pending_history: float
    _big: int
    _little: int
    _swap: WarmSwap | None

    def apply(self, config: EngineConfig, t: float) -> None:
        raise NotImplementedError  # EngineSim's

    def _set(self, config: EngineConfig) -> None:
        raise NotImplementedError  # EngineSim's

    def resident_bytes(self) -> int:
        raise NotImplementedError  # EngineSim's

    def _start_swap(self, old: EngineConfig, config: EngineConfig, t: float) -> bool:
        """Build `config` warm beside the answering context when the real engine would (governor.lab.swap)."""
        if self.current is None or self.stopped or not self.loaded or t < self.ready_s:
            return False  # between answers (or while loading) a change is cold: no answer waits for it
        assert self.tier is not None
        if config.model != old.model or config.kv_type == old.kv_type:
            return False
        need = extra_bytes(self.tier.footprint(), config)
        threads = self._big + self._little
        tokens = self.ctx + self.prefill_left
        why = why_cold(
            old,
            config,
            threads=threads,
            tokens=tokens,
            answer_left=self.answer_left,
            available=self.room_bytes - self.resident_bytes(),
            need=need,
        )
        if why is not None:
            self.stats.cold_why.append(why)
            return False
        goal = tokens - 1 if tokens - 1 >= 2 else 0.0
        self._swap = WarmSwap(config, need, threads // 2, t + self.spec.context_s, goal)
        return True

    def _switch(self, now: float) -> None:
        """The new context is ready: the answer goes on in it with all threads, after evaluating the few tokens that
        came since its last round; the old context is freed. A newer change then applies on top."""
        swap, self._swap = self._swap, None
        assert swap is not None
        self._set(swap.target)
        self.stats.reloads += 1
        self.stats.warm_swaps += 1
        if self.current is not None:
            self.prefill_left += self.ctx - swap.done
            self.answer_left = min(self.answer_left, swap.target.n_ctx - swap.done - self.prefill_left)
        else:  # the answer ended meanwhile: the next turn evaluates the rest of it (prefix reuse)
            self._pending_history += self.ctx - swap.done
        self.ctx = swap.done
        if swap.then is not None:
            self.apply(swap.then, now)

    def _drop_swap(self) -> None:
        """The process stops, pauses or dies: the second context goes with it, the change applies at the next load."""
        if self._swap is not None:
            swap, self._swap = self._swap, None
            self._set(swap.then or swap.target)
