"""The output of the policy core, and the engine settings it asks for.

`EngineConfig` is also the body of the engine's `POST /engine/config` (any subset of its fields) and what the
daemon applies; `Decision` is a line of `governor replay --json` and of `governor why`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class State(StrEnum):
    """Ordered by priority in `PRIORITY` (critical wins)."""

    IDLE = "idle"
    SUSTAINED = "sustained"
    HOT = "hot"
    LOW_BATTERY = "low_battery"
    CRITICAL = "critical"


PRIORITY: tuple[State, ...] = (State.CRITICAL, State.HOT, State.LOW_BATTERY, State.SUSTAINED, State.IDLE)

KvType = Literal["f16", "q8_0", "q4_0"]

# Every number that enters from outside is finite and bounded where it is parsed (a policy, a hold, the engine API).
# A rate cap below 0.1 tok/s is a stalled engine (one token per 10 s), and 1e5 tok/s is beyond any CPU.
RATE_MIN, RATE_MAX = 0.1, 100_000.0
TokensPerS = Annotated[float, Field(ge=RATE_MIN, le=RATE_MAX, allow_inf_nan=False)]
THREADS_MAX = 1024
Threads = Annotated[int, Field(ge=1, le=THREADS_MAX)]
KV_BYTES_PER_ELEMENT: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    threads: int = Field(ge=1, le=256)
    n_ctx: int = Field(ge=64, le=1 << 20)
    kv_type: KvType = "f16"
    model: str  # a tier name in the model ladder
    max_tokens_per_s: TokensPerS | None = None


class Decision(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    t: float
    state: State
    engine: EngineConfig
    reason: str  # one sentence a user can read: "hot: forecast 78.4 °C in 10 s ≥ 76 °C; threads 4→2, ..."
    rule: str  # the rule that fired, e.g. "thermal.forecast_enter"
    readings: dict[str, float | bool | str | None] = Field(default_factory=dict)
    changed: bool = False  # the engine config differs from the previous decision's
    freq_ratio: float | None = None  # CPU clock cap as a share of each cluster's maximum; None: no cap
    # Nothing fits in memory: keep the engine stopped (requests wait) until this is None again; says why.
    engine_wait: str | None = None


class Hold(BaseModel):
    """A client's request (power-profiles-daemon's HoldProfile): pin a state's profile and/or cap some limits.

    `hot` and `critical` override any hold that asks for more than they allow. The daemon drops a hold when
    its client disconnects or at `expires_t`; the policy core only sees the holds in force at a tick.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    owner: str = Field(max_length=200)
    state: State | None = None  # e.g. "idle" for "performance for this chat"
    max_threads: Threads | None = None
    max_tokens_per_s: TokensPerS | None = None
    expires_t: float | None = None
