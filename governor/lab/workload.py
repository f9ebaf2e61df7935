"""What the user asks of the engine: phases of chat or random questions, plus events (charger, other apps, room).

Every random draw comes from the workload's seed, turn by turn, so every policy sees the same questions in the
same order; a faster engine simply gets further through them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from governor.lab.files import load_model, resolve


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Range = tuple[float, float]


class PhaseSpec(Spec):
    """`chat`: a user reads each answer, thinks, asks again (closed loop). `poisson`: questions at random times
    (open loop; they queue if the engine is busy). `idle`: nothing."""

    kind: Literal["chat", "poisson", "idle"]
    duration_s: float = Field(gt=0)
    think_s: Range = (10.0, 40.0)  # chat: pause after an answer before the next prompt
    rate_per_h: float = Field(default=6.0, gt=0)  # poisson: mean questions per hour
    prompt_tokens: Range = (20.0, 150.0)
    answer_tokens: Range = (100.0, 400.0)
    new_conversation: bool = False  # each question starts an empty context (after a system prompt)
    system_tokens: int = Field(default=100, ge=0)
    # LoRA adapters the questions name, by weight; what is left of 1 asks the base model (issue 32). Empty: none.
    adapter_mix: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ranges(self) -> PhaseSpec:
        for field in ("think_s", "prompt_tokens", "answer_tokens"):
            lo, hi = getattr(self, field)
            if not 0 <= lo <= hi:
                raise ValueError(f"{field} must be [low, high] with 0 <= low <= high, got [{lo}, {hi}]")
        weights = list(self.adapter_mix.values())
        if any(not 0 <= w <= 1 for w in weights) or sum(weights) > 1 + 1e-9:
            raise ValueError(f"adapter_mix weights must be in [0, 1] and sum to at most 1, got {self.adapter_mix}")
        return self


class EventSpec(Spec):
    at_s: float = Field(ge=0)
    plugged: bool | None = None  # the charger is connected / pulled
    other_apps_mb: float | None = Field(default=None, ge=0)  # memory the rest of the system now uses
    free_mb: float | None = Field(default=None, ge=0)  # ... or all but this much (scales to any device)
    other_apps_reset: bool = False  # ... or back to the device file's other_apps_mb
    ramp_s: float = Field(default=0.0, ge=0)  # the other programs' memory changes linearly over this long
    ambient_c: float | None = None  # the room (or the pocket) gets warmer or cooler

    @model_validator(mode="after")
    def _one_memory_target(self) -> EventSpec:
        given = [k for k in ("other_apps_mb", "free_mb") if getattr(self, k) is not None] + (
            ["other_apps_reset"] if self.other_apps_reset else []
        )
        if len(given) > 1:
            raise ValueError(f"give one of other_apps_mb, free_mb, other_apps_reset, not {' and '.join(given)}")
        return self


class BackgroundLoad(Spec):
    """Other processes keeping `cores` cores' worth of CPU busy from `from_s` to `to_s` (a backup, a compile)."""

    cores: float = Field(gt=0, le=256)
    from_s: float = Field(ge=0)
    to_s: float

    @model_validator(mode="after")
    def _span(self) -> BackgroundLoad:
        if self.to_s <= self.from_s:
            raise ValueError(f"to_s ({self.to_s}) must be after from_s ({self.from_s})")
        return self


class UpstreamSpec(Spec):
    """A bigger machine the device may route chat turns to (the daemon's `[[upstream]]`; issue 12): routing follows
    the policy's `[slo]`, so a policy without targets never routes."""

    name: str = Field(default="lan", min_length=1)
    latency_s: float = Field(default=0.3, ge=0, le=60)  # network and queue before its prefill starts
    tokens_per_s: float = Field(default=30.0, gt=0, le=1e5)  # its decode speed
    prefill_tokens_per_s: float = Field(default=1000.0, gt=0, le=1e7)  # it evaluates the whole conversation
    radio_w: float = Field(default=0.3, ge=0, le=20)  # the device's radio while a routed answer streams in


class WorkloadSpec(Spec):
    name: str = Field(min_length=1)
    description: str = ""
    seed: int = 1
    phase: tuple[PhaseSpec, ...] = Field(min_length=1)
    event: tuple[EventSpec, ...] = ()
    background_load: tuple[BackgroundLoad, ...] = ()
    upstream: UpstreamSpec | None = None

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phase)

    def without_questions(self) -> WorkloadSpec:
        """The same run with nothing asked: the other programs, the room and the charger as they are (the world
        alone, what no setting of the engine's can take away)."""
        return self.model_copy(update={"phase": (PhaseSpec(kind="idle", duration_s=self.duration_s),)})


def load_workload(name_or_file: str | Path) -> WorkloadSpec:
    return load_model(resolve("workloads", str(name_or_file)), WorkloadSpec)


@dataclass
class Request:
    arrival_s: float
    prompt_tokens: int
    answer_tokens: int
    new_conversation: bool
    system_tokens: int
    first_token_s: float | None = None
    adapter: str | None = None  # the LoRA adapter it names (None: the base model)


class Driver:
    """Hands the engine its requests as virtual time passes; a chat's next turn waits for the previous answer."""

    def __init__(self, spec: WorkloadSpec, seed: int | None = None) -> None:
        self.spec = spec
        base = spec.seed if seed is None else seed
        self._rngs = [np.random.default_rng([base, i]) for i in range(len(spec.phase))]
        self._starts = np.cumsum([0.0, *(p.duration_s for p in spec.phase)])
        self._phase = -1
        self._next_s: float | None = None  # the next arrival in the current phase
        self._waiting = False  # chat: an answer is outstanding
        self._events = sorted(spec.event, key=lambda e: e.at_s)

    def _draw(self, phase: PhaseSpec, rng: np.random.Generator, at_s: float) -> Request:
        request = Request(
            arrival_s=at_s,
            prompt_tokens=round(rng.uniform(*phase.prompt_tokens)),
            answer_tokens=round(rng.uniform(*phase.answer_tokens)),
            new_conversation=phase.new_conversation,
            system_tokens=phase.system_tokens,
        )
        if phase.adapter_mix:  # drawn only then: workloads without adapters keep their random streams
            u, acc = float(rng.uniform()), 0.0
            for name, weight in phase.adapter_mix.items():
                acc += weight
                if u < acc:
                    request.adapter = name
                    break
        return request

    def _enter(self, i: int) -> None:
        self._phase = i
        self._waiting = False
        if i >= len(self.spec.phase):
            self._next_s = None
            return
        phase = self.spec.phase[i]
        start = float(self._starts[i])
        if phase.kind == "chat":
            self._next_s = start
        elif phase.kind == "poisson":
            self._next_s = start + float(self._rngs[i].exponential(3600.0 / phase.rate_per_h))
        else:
            self._next_s = None

    def arrivals(self, t: float) -> list[Request]:
        """Requests that arrive by virtual time `t` (each exactly once)."""
        out: list[Request] = []
        while True:
            boundary = self._starts[self._phase + 1] if self._phase + 1 < len(self.spec.phase) else None
            if boundary is not None and t >= boundary and (self._next_s is None or self._next_s >= boundary):
                self._enter(self._phase + 1)
                continue
            if self._next_s is None or self._next_s > t or self._phase >= len(self.spec.phase):
                return out
            phase = self.spec.phase[self._phase]
            rng = self._rngs[self._phase]
            out.append(self._draw(phase, rng, self._next_s))
            if phase.kind == "chat":
                self._next_s, self._waiting = None, True
            else:
                self._next_s += float(rng.exponential(3600.0 / phase.rate_per_h))

    def answered(self, t: float) -> None:
        """The engine finished (or failed) the outstanding chat turn at `t`: the user reads, thinks, asks again."""
        if not self._waiting or self._phase >= len(self.spec.phase):
            return
        phase = self.spec.phase[self._phase]
        self._waiting = False
        self._next_s = t + float(self._rngs[self._phase].uniform(*phase.think_s))

    def background_cores(self, t: float) -> float:
        """The CPU other processes want at `t` (cores' worth)."""
        return sum(b.cores for b in self.spec.background_load if b.from_s <= t < b.to_s)

    def events(self, t: float) -> list[EventSpec]:
        out = []
        while self._events and self._events[0].at_s <= t:
            out.append(self._events.pop(0))
        return out
