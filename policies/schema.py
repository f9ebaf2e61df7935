"""The policy file: one validated pydantic model per TOML table. Every threshold and key is spelled here, once.

State names come from `policies.decision.State`; `states` is keyed by them so no state name is repeated here.
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, Strict, field_serializer, field_validator, model_validator

from policies.decision import THREADS_MAX, Ctx, KvType, ModelName, NBatch, PoolMiB, State, Threads, TokensPerS

KV_ORDER: tuple[KvType, ...] = ("f16", "q8_0", "q4_0")  # most precise first; later = smaller KV cache
MODEL_LARGEST = "largest"  # model selectors resolved against the ladder
MODEL_SMALLEST = "smallest"

# CPU/SoC zone types seen in the wild (ANCHORS: Termux section; x86 coretemp/k10temp; Pi cpu-thermal), and the skin
# and case sensors a phone's vendor limits on: each zone is judged against its own trip (policies/readings.py), so a
# 43 °C skin trip and a 95 °C CPU trip can both be trusted.
DEFAULT_ZONES: tuple[str, ...] = (
    "cpu*",
    "soc*",
    "*_thermal",
    "*-thermal",
    "x86_pkg_temp",
    "coretemp*",
    "k10temp*",
    "mtktscpu",
    "tsens_tz_sensor*",
    "acpitz",
    "*skin*",
    "xo_therm*",
    "case_therm*",
    "quiet_therm*",
    "back_therm*",
)

# Upper bounds that make sense for a device governor: a tick at most once a minute, waits of at most an hour.
HOUR_S = 3600.0
Seconds = Annotated[float, Field(ge=0, le=HOUR_S)]
PositiveSeconds = Annotated[float, Field(gt=0, le=HOUR_S)]
TickSeconds = Annotated[float, Field(ge=0.01, le=60)]
Celsius = Annotated[float, Field(ge=-40, le=200)]
Margin = Annotated[float, Field(ge=0, le=60)]
Fraction = Annotated[float, Field(ge=0, le=1)]
Percent = Annotated[float, Field(ge=0, le=100)]
MegaBytes = Annotated[float, Field(ge=0, le=1 << 24)]  # 16 TiB
Gain = Annotated[float, Field(gt=0, le=1000)]


class StrictModel(BaseModel):
    # strict: `threads = "4"` is a mistake to report, not a string to convert; inf/nan are never a setting.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class Profile(StrictModel):
    """What a state asks of the engine. `min_*` are the PI controller's lower bounds (used by the hot state)."""

    threads: Threads  # "all" (read as THREADS_MAX): every CPU online (on cores of different speed: the fastest count)
    min_threads: Threads | None = None
    n_ctx: Ctx
    kv_type: KvType = "f16"
    # a ladder tier, "largest", "smallest": a name, never a path (`policy check` cannot see the ladder; reload can)
    model: ModelName = Field(default=MODEL_LARGEST, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
    max_tokens_per_s: TokensPerS | None = None
    min_tokens_per_s: TokensPerS | None = None

    @model_validator(mode="after")
    def _bounds(self) -> Profile:
        if self.min_threads is not None and self.min_threads > self.thread_limit:
            raise ValueError(f"min_threads {self.min_threads} > threads {self.threads}")
        if self.min_tokens_per_s is not None and (
            self.max_tokens_per_s is None or self.min_tokens_per_s > self.max_tokens_per_s
        ):
            raise ValueError("min_tokens_per_s needs a max_tokens_per_s at least as large")
        return self

    @field_validator("threads", mode="before")
    @classmethod
    def _all(cls, value: object) -> object:
        return THREADS_MAX if value == ALL else value

    @field_serializer("threads")
    def _show_all(self, value: int) -> int | str:
        return ALL if value >= THREADS_MAX else value

    @property
    def thread_limit(self) -> int:
        """`threads` as a number: "all" is no limit of the profile's own (the CPUs online bound it; `all_of`)."""
        return self.threads

    @property
    def rate_range(self) -> tuple[float | None, float | None]:
        """(min_tokens_per_s, max_tokens_per_s): the PI controller's bounds on the rate cap."""
        return self.min_tokens_per_s, self.max_tokens_per_s


class Limits(NamedTuple):
    """A profile as the tick uses it: plain values, cheap to copy (a pydantic copy per tick would dominate)."""

    state: State
    threads: int
    n_ctx: int
    kv_rank: int
    model: str
    rate: float | None

    @classmethod
    def of(cls, state: State, p: Profile) -> Limits:
        return cls(state, p.thread_limit, p.n_ctx, KV_ORDER.index(p.kv_type), p.model, p.max_tokens_per_s)

    def at(self, threads: int, rate: float | None) -> Limits:
        """This profile with other threads and rate cap (`_replace`, at a third of its cost)."""
        return Limits(self.state, threads, self.n_ctx, self.kv_rank, self.model, rate)


ALL = "all"  # a profile's `threads = "all"`
UNKNOWN_CPUS = 4  # "all" threads where the snapshot does not say how many CPUs are online


def all_of(threads: int, cpus: int | None) -> int:
    """A thread limit on `cpus` online CPUs (None: unknown): "all" (THREADS_MAX) is every CPU, else UNKNOWN_CPUS."""
    return min(threads, cpus) if cpus else (UNKNOWN_CPUS if threads >= THREADS_MAX else threads)


class Timing(StrictModel):
    interval_s: TickSeconds = 1.0  # tick while nothing is happening (the kernel's 1 s)
    mitigating_interval_s: TickSeconds = 0.25  # tick while mitigating or a change is pending
    # Tick while calm: engine idle (it says when a request arrives) and far from every threshold. thermald polls
    # at 10 s when cool; udev events, a request and a reload still wake the loop at once.
    calm_interval_s: TickSeconds = 5.0
    calm_margin_c: Margin = 10.0  # calm needs the temperature and its forecast this far below hot entry
    calm_battery_margin_percent: Percent = 10.0  # and the battery this far above low (charging or not)
    min_dwell_s: Seconds = 2.0  # no state change sooner than this after the last one, except into critical
    recover_dwell_s: Seconds = 20.0  # no move to a less safe state sooner than this after entering the current one
    recover_step_s: PositiveSeconds = 10.0  # coming back: threads rise one at a time, one step per this


class Debounce(StrictModel):
    enter_debounce_s: Seconds = 1.0  # the condition must hold this long before it counts
    exit_debounce_s: Seconds = 5.0  # and be gone this long before it stops counting


class Activity(Debounce):
    """`sustained` = the engine was busy for this fraction of the window."""

    window_s: PositiveSeconds = 30.0
    enter_fraction: Fraction = 0.5
    exit_fraction: Fraction = 0.2
    enter_debounce_s: Seconds = 0.0

    @model_validator(mode="after")
    def _hysteresis(self) -> Activity:
        if self.exit_fraction >= self.enter_fraction:
            raise ValueError("exit_fraction must be below enter_fraction (hysteresis)")
        return self


class PiGains(StrictModel):
    """Kernel power_allocator law on a normalised output in [0, 1]; None = the kernel's default gains."""

    k_pu: Gain | None = None  # per °C below the setpoint; default 2/(setpoint - exit)
    k_po: Gain | None = None  # per °C above the setpoint; default 1/(setpoint - exit)
    k_i: float | None = Field(default=None, ge=0, le=1000)  # per °C·s; default k_pu/10


class Thermal(Debounce):
    zones: tuple[Annotated[str, Field(min_length=1, max_length=200)], ...] = Field(
        default=DEFAULT_ZONES, max_length=100, strict=False
    )  # fnmatch patterns on the zone type
    use_battery_temp: bool = False  # count the battery's temperature as a zone named "battery"
    plausible_max_c: Celsius = 135.0  # a zone reading at or above this is a broken sensor and ignored
    trip_c: Celsius | None = None  # explicit trip; default: the lowest passive trip among trusted zones
    fallback_trip_c: Celsius = 85.0  # when neither the policy nor the device names one
    hot_c: Celsius | None = None  # explicit hot entry; default trip - hot_margin_c
    hot_margin_c: Margin = 5.0
    hysteresis_c: Margin = Field(default=4.0, gt=0)  # leave hot below entry - this
    control_margin_c: Margin = 2.0  # PI setpoint = trip - this
    critical_c: Celsius | None = None  # explicit; default the lowest critical trip - critical_margin_c
    critical_margin_c: Margin = 5.0
    # Critical this far over each zone's passive trip (where that is lower than its own critical trip - margin): a
    # limit relative to the device, e.g. a Pi's firmware hard throttle 5 °C over its soft one, a phone's skin.
    critical_over_trip_c: Margin | None = None
    fallback_critical_c: Celsius = 100.0
    critical_hysteresis_c: Margin = Field(default=5.0, gt=0)
    forecast_horizon_s: Seconds = 10.0  # ADPF guidance: about 10 s ahead
    forecast_window_s: PositiveSeconds = 20.0
    forecast_min_points: int = Field(default=4, ge=2, le=1000)
    forecast_max_rise_c: Margin = 15.0  # noise guard: never forecast more than this above the reading
    # Trusted zones that give no plausible reading for this long (garbage, absurd, vanished) -> hot limits, reason
    # "no trustworthy temperature": a governor blind to heat must not run at full speed.
    untrusted_grace_s: Seconds = 5.0
    pi: PiGains = PiGains()

    @model_validator(mode="after")
    def _setpoint_above_exit(self) -> Thermal:
        if self.control_margin_c >= self.hot_margin_c + self.hysteresis_c:
            raise ValueError("control_margin_c must be below hot_margin_c + hysteresis_c (setpoint above hot exit)")
        return self


class Battery(Debounce):
    low_percent: Percent = 20.0  # UPower's default "low"
    hysteresis_percent: Percent = 5.0
    critical_percent: Percent = 5.0
    enter_debounce_s: Seconds = 5.0

    @model_validator(mode="after")
    def _order(self) -> Battery:
        if self.critical_percent >= self.low_percent:
            raise ValueError("critical_percent must be below low_percent")
        return self


class Critical(Debounce):
    """Debounce of the critical state, whatever its cause (thermal, battery, memory floor)."""

    enter_debounce_s: Seconds = 0.5
    exit_debounce_s: Seconds = 10.0


class Memory(StrictModel):
    reserve_mb: MegaBytes = 256.0  # left free for everything else
    overhead_mb: MegaBytes = 150.0  # engine runtime beyond weights, KV and compute buffer
    floor_mb: MegaBytes = 100.0  # available below this -> critical
    floor_hysteresis_mb: MegaBytes = 100.0
    grow_margin_mb: MegaBytes = 64.0  # available must rise this much before we use more
    psi_enter: Percent = 10.0  # psi some avg10 at or above this: shrink
    psi_exit: Percent = 2.0
    psi_shrink_fraction: Fraction = 0.25  # each shrink asks for this much less memory than the current config
    psi_step_s: PositiveSeconds = 5.0  # at most one shrink per this while pressure stays high
    psi_exit_debounce_s: Seconds = 30.0
    min_ctx: Ctx = 512
    ctx_multiple: int = Field(default=256, ge=1, le=1 << 16)
    n_batch: NBatch = 512  # the engine's, unless memory asks for less
    min_n_batch: NBatch = 64  # lowered (halved) down to this before a smaller tier
    kv_fallback: bool = True  # quantise the KV cache further before shrinking the context
    # When nothing fits the budget, the smallest setting still runs (slowly, its weights re-read from storage) if
    # what the killer counts of it leaves this much of the memory the engine could hold: the engine stops only when
    # a kill is predicted (policies/memplan.py).
    kill_margin_mb: MegaBytes = 100.0
    # The engine's LoRA adapter pool (when the ladder names adapters): this much when memory allows; memory shrinks
    # it first, down to min_lora_pool_mib (0: no adapter can run then; your largest adapter keeps one servable).
    lora_pool_mib: PoolMiB = 64.0
    min_lora_pool_mib: PoolMiB = 0.0

    @model_validator(mode="after")
    def _psi(self) -> Memory:
        if self.psi_exit >= self.psi_enter:
            raise ValueError("psi_exit must be below psi_enter (hysteresis)")
        if self.min_lora_pool_mib > self.lora_pool_mib:
            raise ValueError("min_lora_pool_mib must not exceed lora_pool_mib")
        return self


class Power(StrictModel):
    """The CPU frequency actuator and the prior of the device model behind the hot state's power allocator."""

    freq_cap: bool = True  # cap the CPU clock in hot and critical where the daemon may write it (else threads/rate)
    # With the clock as the actuator the power moves in small steps: the PI setpoint can sit this close to the trip.
    control_margin_c: float = Field(default=0.5, ge=0, le=60)
    # While the kernel holds a throttling step of its own, the setpoint drops to trip - this: a passive trip's
    # hysteresis (3 °C on a Pi, thermal_zone*/trip_point_*_hyst) keeps the step until the zone falls that far under.
    throttled_margin_c: float = Field(default=3.5, ge=0, le=60)
    # The trip guard: this close to the trip and still rising, the clock drops a step per tick whatever the PI says
    # (a load step outruns the PI's gentle gains; the kernel would step only at the trip). 0: only at the trip.
    guard_margin_c: float = Field(default=0.25, ge=0, le=60)
    idle_w: float = Field(default=2.0, ge=0, le=1000)  # prior: the device's power with the engine idle
    core_w: float = Field(default=1.5, gt=0, le=1000)  # prior: one busy core at the top clock
    freq_exponent: float = Field(default=2.5, ge=1, le=4)  # prior: a core's power ∝ f^k (f·V², V rising with f)
    thread_tok_s: float | None = Field(default=None, gt=0, le=1e5)  # prior: decode tokens/s of one thread


class EngineOptions(StrictModel):
    """How the engine process is run (passed on its command line when the daemon starts it)."""

    # Idle this long -> the engine unloads its model (the next request loads it again); 0 = never. Ollama: 5 min.
    keep_alive_s: Seconds = Field(default=300.0, le=1e7)
    # A streamed answer's text leaves at most this often, several tokens a chunk (the first at once); 0 = every token;
    # unset = auto: 200 ms when the decode threads take every CPU, else 0 (`governor engine --stream-interval-ms`).
    stream_interval_ms: float | None = Field(default=None, ge=0, le=10_000)


class Contention(StrictModel):
    """Threads that fit the cores other processes leave free (llama.cpp's threads wait for each other at every
    step, so one whose core is taken stalls them all), confirmed or corrected by the measured decode speed."""

    enabled: bool = True
    take_fraction: Fraction = 0.5  # another process's use of this much of a core counts as a taken core
    release_fraction: Fraction = 0.25  # and is given back once the use falls below this (hysteresis)
    enter_debounce_s: Seconds = 1.0  # taken this long before threads drop
    dwell_s: Seconds = 15.0  # free this long (continuously) before threads come back
    measure_margin: float = Field(default=0.15, ge=0, le=10)  # fewer threads win when this much faster
    measure_max_age_s: PositiveSeconds = 120.0  # a measurement older than this is forgotten (and re-measured)
    measure_settle_s: Seconds = 2.5  # the engine's tokens/s window must have seen only the current threads
    # Upward probe: the capped count is the only one measured under a load, so one thread more is tried for at most
    # probe_max_s once the count has held probe_interval_s (0: never); each probe that loses doubles the wait (up to
    # 8x). On a busy machine (many runnable tasks) the scheduler shares per thread, and more threads can win.
    probe_interval_s: Seconds = 30.0
    probe_max_s: PositiveSeconds = 8.0

    @model_validator(mode="after")
    def _hysteresis(self) -> Contention:
        if self.release_fraction >= self.take_fraction:
            raise ValueError("release_fraction must be below take_fraction (hysteresis)")
        return self


class Changes(StrictModel):
    """Every change has a price (policies/changecost.py): a change that is not urgent waits until the setting in force
    has lasted `amortize` times the predicted cost of leaving it, at least `live_dwell_s` (so at most 60 /
    live_dwell_s changes a minute), and a model switch at most once per `model_dwell_s`. Urgent changes (a predicted
    kill, critical, near the trip, a contended core, a client's hold) pay any price at once."""

    enabled: bool = True
    live_dwell_s: Seconds = 30.0
    amortize: float = Field(default=20.0, ge=0, le=1000)
    model_dwell_s: Seconds = 300.0
    # Priors of the price where the engine does not report them: prompt evaluation runs this many times the decode
    # rate (compute-bound, all threads busy; llama.cpp on CPUs: 4-7x), weights load at this speed (MB/s).
    prefill_ratio: float = Field(default=4.0, gt=0, le=100)
    load_mb_s: float = Field(default=200.0, gt=0, le=1e5)
    context_s: float = Field(default=0.3, ge=0, le=60)  # building a new context


class SloTargets(StrictModel):
    """One request class's targets; None: no target of that kind."""

    min_tokens_per_s: TokensPerS | None = None  # decode speed the user needs (e.g. reading speed, ~5-10 tok/s)
    max_ttft_s: float | None = Field(default=None, gt=0, le=600)  # time to the first token


class Slo(SloTargets):
    """Service-level targets for a chat request, and when the daemon may send one off the device to meet them
    (only to an upstream the daemon's config names: no upstream, no routing). The top-level targets are for
    interactive requests (the default); `[slo.background]` for requests that say they are background work."""

    background: SloTargets = SloTargets()
    # Hysteresis on the way back: off the device until the prediction beats the target by this fraction ...
    back_margin: Fraction = 0.15
    back_after_s: Seconds = 10.0  # ... continuously for this long (ticks judge it, not only requests)
    # "about to cross": the battery this close above low (on battery power) counts as low already
    battery_margin_percent: Percent = 2.0


class Policy(StrictModel):
    name: str = Field(default="custom", max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")  # no escape codes in output
    description: str = Field(default="", max_length=10_000)
    timing: Timing = Timing()
    activity: Activity = Activity()
    thermal: Thermal = Thermal()
    battery: Battery = Battery()
    critical: Critical = Critical()
    memory: Memory = Memory()
    power: Power = Power()
    engine: EngineOptions = EngineOptions()
    contention: Contention = Contention()
    changes: Changes = Changes()
    slo: Slo = Slo()
    states: dict[Annotated[State, Strict(False)], Profile]  # TOML keys are strings; State validates them

    @field_validator("states")
    @classmethod
    def _all_states(cls, states: dict[State, Profile]) -> dict[State, Profile]:
        missing = [s.value for s in State if s not in states]
        if missing:
            raise ValueError(f"missing a profile for {', '.join(missing)}")
        if states[State.HOT].max_tokens_per_s is None:
            raise ValueError(f"{State.HOT.value}.max_tokens_per_s is required: the PI controller caps the rate")
        return states
