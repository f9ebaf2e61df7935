"""The output of the policy core, and the engine settings it asks for.

`EngineConfig` is the one shape of the engine's settings: what a decision asks for, what `governor engine` takes
on its command line (`flags`), what its `POST /engine/config` takes (any subset of the fields, merged with `change`)
and reports, what the daemon applies and shows, and what the lab's simulated engine runs. It is validated here, once.
`Decision` is a line of `governor replay --json` and of `governor why`.

Adding a knob: a field on `EngineConfig` with its `Knob` (docs/architecture.md, "Adding a knob").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, computed_field


class State(StrEnum):
    """Ordered by priority in `PRIORITY` (critical wins)."""

    IDLE = "idle"
    SUSTAINED = "sustained"
    HOT = "hot"
    LOW_BATTERY = "low_battery"
    CRITICAL = "critical"


PRIORITY: tuple[State, ...] = (State.CRITICAL, State.HOT, State.LOW_BATTERY, State.SUSTAINED, State.IDLE)
RANK = {s: i for i, s in enumerate(PRIORITY)}  # 0 = safest

KvType = Literal["f16", "q8_0", "q4_0"]

# Every number that enters from outside is finite and bounded where it is parsed (a policy, a hold, the engine API).
# A rate cap below 0.1 tok/s is a stalled engine (one token per 10 s), and 1e5 tok/s is beyond any CPU.
RATE_MIN, RATE_MAX = 0.1, 100_000.0
TokensPerS = Annotated[float, Field(ge=RATE_MIN, le=RATE_MAX)]
THREADS_MAX = 256
Threads = Annotated[int, Field(ge=1, le=THREADS_MAX)]
Ctx = Annotated[int, Field(ge=64, le=1 << 20)]
ModelName = Annotated[str, Field(min_length=1, max_length=200)]
NBatch = Annotated[int, Field(ge=32, le=8192)]
PoolMiB = Annotated[float, Field(ge=0, le=1 << 20)]
KV_BYTES_PER_ELEMENT: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@dataclass(frozen=True)
class Knob:
    """How one engine setting is named, shown and applied (metadata on an `EngineConfig` field)."""

    label: str  # in a reason: "threads 4→2", "KV f16→q8_0"
    help: str  # the `governor engine` flag's help
    live: bool = False  # applied between two tokens; else a reload (a new context) applies it
    flag: str | None = None  # the `governor engine` flag; None: --the-field-name; "": none
    unit: str = ""  # after a value: "rate cap 5 tok/s"
    off: str = ""  # what None means: "no rate cap" (and "rate cap lifted" when it becomes None)
    quiet: object = None  # a value not worth a word in a description (the LoRA pool of a ladder without adapters)

    def show(self, value: object) -> str:
        return self.off if value is None else f"{self.label} {readable(value)}{self.unit}"

    def change(self, before: object, after: object) -> str:
        """A cap that can be off reads as its new state; a setting always present reads as before→after."""
        if after is None:
            return f"{self.label} lifted"
        if self.off:
            return self.show(after)
        return f"{self.label} {readable(before)}→{readable(after)}{self.unit}"


def readable(x: object) -> str:
    """A value for a sentence; never raises (an explanation must not kill a tick)."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:g}" if x == int(x) else f"{x:.1f}"
    return str(x)


class EngineConfig(BaseModel):
    """The engine's settings (see the module's docstring). Field order is the order they are shown in."""

    # strict: `threads = "4"` is a mistake to report, not a string to convert (command-line text: change(strict=False)).
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    threads: Annotated[Threads, Knob("threads", "compute threads (default: the CPUs this process may use)", live=True)]
    n_ctx: Annotated[Ctx, Knob("n_ctx", "context size in tokens (default: the tier's n_ctx, or 2048)", flag="--ctx")]
    kv_type: Annotated[KvType, Knob("KV", "KV-cache type (default: the tier's kv_type, or f16)", flag="--kv")] = "f16"
    model: Annotated[ModelName, Knob("model", "a tier name in the model ladder", flag="")]
    max_tokens_per_s: Annotated[
        TokensPerS | None,
        Knob("rate cap", "cap on the decode rate (default: none)", live=True, unit=" tok/s", off="no rate cap"),
    ] = None
    n_batch: Annotated[
        NBatch,
        Knob(
            "n_batch",
            "prompt tokens evaluated per step, llama.cpp's n_batch and n_ubatch (default: 512); its "
            "compute buffer is a peak allocation: memory lowers it",
        ),
    ] = 512
    lora_pool_mib: Annotated[
        PoolMiB,
        Knob(
            "LoRA pool",
            "MiB the engine may hold of LoRA adapters and the KV caches parked by adapter switches (default 64); "
            "least recently used ones are freed to stay within it, and memory shrinks it first",
            live=True,
            unit=" MiB",
            quiet=0.0,
        ),
    ] = 64.0

    def change(self, update: Mapping[str, Any], *, strict: bool = True) -> EngineConfig:
        """These settings with `update`'s fields replaced, validated as a whole (ValidationError names the field).

        A partial change is a mapping of some fields: absent keeps a value, `None` removes a cap.
        """
        return type(self).model_validate({**self.model_dump(), **update}, strict=strict)

    def needs_reload(self, other: EngineConfig) -> bool:
        """Going from these settings to `other` needs a new context (a reload), not just a change between tokens."""
        return any(getattr(self, name) != getattr(other, name) for name, knob in KNOBS.items() if not knob.live)

    def describe(self, prev: EngineConfig | None = None, *, live_only: bool = False) -> str:
        """ "threads 4, n_ctx 2048, KV f16, model m, no rate cap"; with `prev` only what changed ("threads 4→2")."""
        parts = []
        for name, knob in KNOBS.items():
            value = getattr(self, name)
            if prev is None:
                if (knob.live or not live_only) and (knob.quiet is None or value != knob.quiet):
                    parts.append(knob.show(value))
            elif getattr(prev, name) != value:
                parts.append(knob.change(getattr(prev, name), value))
        return ", ".join(parts)

    def flags(self) -> list[str]:
        """The `governor engine` command-line flags that start an engine with these settings."""
        argv = []
        for name in KNOBS:
            value = getattr(self, name)
            if flag_of(name) and value is not None:
                argv += [flag_of(name), str(value)]
        return argv


def flag_of(name: str) -> str:
    """A setting's `governor engine` flag ("" for none: the model is --tier / --model)."""
    knob = KNOBS[name]
    return knob.flag if knob.flag is not None else "--" + name.replace("_", "-")


KNOBS: dict[str, Knob] = {
    name: next(m for m in info.metadata if isinstance(m, Knob)) for name, info in EngineConfig.model_fields.items()
}


Readings = dict[str, float | bool | str | None]
Why = Callable[[], tuple[str, Readings]]


class Outlook(NamedTuple):
    """What the readings say may come next, typed, for the service-level prediction (policies/slo.py): the forecast
    (to 0.01 °C, as `why` shows it) against hot's entry, and the battery on battery power."""

    forecast_c: float | None = None
    hot_enter_c: float | None = None
    battery_percent: float | None = None
    on_power: bool | None = None


UNKNOWN = Outlook()


class Decision(BaseModel):
    """A tick's state and engine settings, the rule that fired, and why (`reason`, `readings`).

    The why is built when first read (`governor status`, `why`, a trace, a log line, the routing gate), not at every
    tick: hot, a decision is made four times a second and almost none is ever read, and the sentence is a sixth of
    the tick's work. Everything it is built from is immutable, so it says what was true at its tick whenever read.
    `Decision(reason=..., readings=..., outlook=...)` gives them directly (the lab's `none`, tests)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    t: float
    state: State
    engine: EngineConfig
    rule: str  # the rule that fired, e.g. "thermal.forecast_enter"
    changed: bool = False  # the engine config differs from the previous decision's
    freq_ratio: float | None = None  # CPU clock cap as a share of each cluster's maximum; None: no cap
    # Nothing fits in memory: keep the engine stopped (requests wait) until this is None again; says why.
    engine_wait: str | None = None
    # The CPUs the engine's threads run on (the fastest cores for their count; policies/cores.py); None: wherever the
    # scheduler puts them.
    affinity: tuple[int, ...] | None = None
    _why: Why | None = PrivateAttr(default=None)
    _outlook: Outlook = PrivateAttr(default_factory=lambda: UNKNOWN)  # a default would be deep-copied (10 µs)

    def __init__(
        self,
        *,
        reason: str = "",
        readings: Mapping[str, float | bool | str | None] | None = None,
        outlook: Outlook = UNKNOWN,
        **fields: Any,
    ) -> None:
        super().__init__(**fields)
        given = (reason, dict(readings or {}))
        # Both private attributes in one write (pydantic's per-attribute __setattr__ costs ~6 µs each).
        object.__setattr__(self, "__pydantic_private__", {"_why": lambda: given, "_outlook": outlook})

    @classmethod
    def explained_by(
        cls,
        why: Why,
        *,
        t: float,
        state: State,
        engine: EngineConfig,
        rule: str,
        changed: bool,
        freq_ratio: float | None,
        engine_wait: str | None,
        outlook: Outlook,
        affinity: tuple[int, ...] | None = None,
    ) -> Decision:
        """The state machine's, every tick: fields it built from validated values, and the why to build later. Set
        as `model_construct` sets them, without its generic pass over the fields (4 µs here, 16 there: a tenth of a
        hot decide())."""
        decision = cls.__new__(cls)
        fields = {"t": t, "state": state, "engine": engine, "rule": rule, "changed": changed}
        fields |= {"freq_ratio": freq_ratio, "engine_wait": engine_wait, "affinity": affinity}
        object.__setattr__(decision, "__dict__", fields)
        object.__setattr__(decision, "__pydantic_fields_set__", set(fields))
        object.__setattr__(decision, "__pydantic_extra__", None)
        object.__setattr__(decision, "__pydantic_private__", {"_why": why, "_outlook": outlook})
        return decision

    @property
    def outlook(self) -> Outlook:
        """What may come next (unknown for a decision read back from JSON, or not made by the policy core)."""
        return self._outlook

    def __eq__(self, other: object) -> bool:
        """Equal fields and an equal why (however each was given)."""
        if not isinstance(other, Decision):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in Decision.model_fields) and (
            self._explained == other._explained
        )

    def __hash__(self) -> int:
        return hash((self.t, self.state, self.engine, self.rule))

    @cached_property
    def _explained(self) -> tuple[str, Readings]:
        return ("", {}) if self._why is None else self._why()

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reason(self) -> str:
        """One sentence a user can read: "hot: forecast 78.4 °C in 10 s ≥ 76 °C; threads 4→2, ..." """
        return self._explained[0]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def readings(self) -> Readings:
        """The readings behind it (temperature, trip, forecast, battery, memory, the budget, ...)."""
        return self._explained[1]


class HoldAsk(BaseModel):
    """What a client's hold asks for: a state's profile and/or caps on some settings (`governor hold`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    state: State | None = Field(default=None, strict=False)  # e.g. "idle" for "performance for this chat"
    max_threads: Threads | None = None
    max_tokens_per_s: TokensPerS | None = None
    max_tier: ModelName | None = None  # no larger model than this ladder tier (the supervisor's after a memory kill)
    max_ctx: Ctx | None = None

    def asks(self) -> dict[str, object]:
        return {k: v for k, v in self.model_dump(include=set(HoldAsk.model_fields)).items() if v is not None}


class Hold(HoldAsk):
    """A client's request (power-profiles-daemon's HoldProfile): pin a state's profile and/or cap some limits.

    `hot` and `critical` override any hold that asks for more than they allow. The daemon drops a hold when
    its client disconnects or at `expires_t`; the policy core only sees the holds in force at a tick.
    """

    owner: str = Field(max_length=200)
    expires_t: float | None = None
