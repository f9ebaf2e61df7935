"""The simulated engine's warm swap: a KV type change mid-answer built beside the answering context, as the real
engine does it (governor.engine.swap, docs/engine.md "A KV-type change mid-answer, warm"), by the same plan
(governor.engine.plan: `why_cold`, `second_context_bytes`, `next_round`).

Warm when the change keeps the model, the engine runs two threads or more, the answer so far plus room for the rest
fits the new context, and the memory available as the world sees it (room left by other programs minus the engine's
resident memory) minus the new KV cache and compute buffer leaves the plan's reserve. The new context is built
(`context_s`), then half of the threads evaluate the answer's tokens in it while the answer goes on with the other
half; then a few catch-up rounds evaluate the tokens that came meanwhile, and the engine switches (EngineSim).
"""

from __future__ import annotations

from dataclasses import dataclass

from governor.engine.plan import answer_room, next_round, second_context_bytes, why_cold
from governor.lab.device import SimModelSpec
from policies.decision import EngineConfig


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
        """Whether the engine switches now, the answer having `tokens`; starts a catch-up round when the plan says
        one is due (governor.engine.plan.next_round)."""
        if now < self.ready_s or self.done < self.goal - 1e-9:
            return False
        goal = next_round(self.done, tokens, self.rounds)
        if goal is not None:
            self.goal = goal
            self.rounds += 1
            return False
        return True


def start(
    old: EngineConfig,
    target: EngineConfig,
    *,
    tier: SimModelSpec,
    threads: int,
    tokens: float,
    answer_left: float,
    available: float,
    now: float,
    context_s: float,
) -> WarmSwap | str:
    """The warm build of `target` beside the answering context of `old` (the answer's `tokens` so far, `answer_left`
    to come; `available` bytes as the world sees them), or why the plan says cold."""
    need = second_context_bytes(tier.footprint(), target)
    room = answer_room(target.n_ctx, round(answer_left))
    why = why_cold(old, target, threads=threads, tokens=tokens, room=room, memory=lambda: (need, available))
    if why is not None:
        return why
    first = next_round(0.0, tokens, 0)
    return WarmSwap(target, need, threads // 2, now + context_s, 0.0 if first is None else first)
