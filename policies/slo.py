"""Will the device meet the service-level targets (`[slo]`) for a request now? Pure: readings and time come in.

The prediction (`predict`) combines what was measured with what the policy is doing and about to do:

- decode: the engine's measured decode speed (its own EWMA, rate-cap waits excluded), scaled by the threads the
  engine will run with over the threads it was measured at (linear: optimistic; the next local answer corrects it),
  then limited by the rate cap in force and, when the state's forecast says hot soon or the battery is about to
  cross low, by that state's profile;
- time to first token: the estimated prompt tokens over the measured prefill speed, scaled the same way;
- a prompt longer than the context in force misses whatever the targets (the engine would drop earlier messages).

Unknown (no answer measured yet) counts as meeting the target: the device is not sent away on a guess.
`RouteGate` adds the hysteresis: off the device as soon as the prediction misses, back only once it beats the target
by `back_margin` for `back_after_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.decision import Decision, State
from policies.schema import Policy, Slo


@dataclass(frozen=True)
class Measured:
    """What the device showed: decode and prefill speeds, each with the threads it was measured at."""

    decode_tokens_per_s: float | None = None
    decode_threads: int | None = None
    prefill_tokens_per_s: float | None = None
    prefill_threads: int | None = None


@dataclass(frozen=True)
class Prediction:
    meets: bool
    tokens_per_s: float | None  # predicted delivered decode rate; None: unknown
    ttft_s: float | None  # predicted time to first token for this prompt; None: unknown or no prompt
    reason: str  # why it misses (or "meets ...")
    kind: str = "meets"  # what misses: "rate", "ttft" or "context" (a small set: a metrics label)

    def as_dict(self) -> dict[str, float | bool | str | None]:
        rate = None if self.tokens_per_s is None else round(self.tokens_per_s, 2)
        ttft = None if self.ttft_s is None else round(self.ttft_s, 3)
        return {"meets": self.meets, "tokens_per_s": rate, "ttft_s": ttft, "reason": self.reason}


def _n(value: float) -> str:
    return f"{value:.3g}"


def _scaled(speed: float | None, measured_at: int | None, threads: int) -> float | None:
    if speed is None or speed <= 0:
        return None
    return speed * threads / measured_at if measured_at else speed


def _coming(policy: Policy, decision: Decision, slo: Slo) -> tuple[State, str] | None:
    """A state the readings say is about to be entered (its limits count already), with why."""
    o = decision.outlook
    if decision.state in (State.IDLE, State.SUSTAINED, State.LOW_BATTERY):
        forecast, enter = o.forecast_c, o.hot_enter_c
        if forecast is not None and enter is not None and forecast >= enter:
            return State.HOT, f"forecast {forecast:.1f} °C ≥ hot entry {enter:.1f} °C"
    if decision.state in (State.IDLE, State.SUSTAINED):
        pct = o.battery_percent
        low = policy.battery.low_percent + slo.battery_margin_percent
        if pct is not None and o.on_power is False and pct <= low:
            return State.LOW_BATTERY, f"battery {pct:.0f} % about to cross low ({policy.battery.low_percent:g} %)"
    return None


def predict(
    policy: Policy,
    decision: Decision | None,
    measured: Measured,
    prompt_tokens: int | None = None,
    *,
    margin: float = 0.0,
    background: bool = False,
) -> Prediction:
    """Whether the device meets the policy's `[slo]` for a request of `prompt_tokens` (None: judge decode only),
    with `margin` as a fraction the prediction must beat the targets by (the way back uses `back_margin`);
    `background`: against `[slo.background]`."""
    slo = policy.slo
    targets = slo.background if background else slo
    if decision is None:
        return Prediction(True, None, None, "no decision yet")
    threads = decision.engine.threads
    caps: list[tuple[float, str]] = []
    if decision.engine.max_tokens_per_s is not None:
        caps.append((decision.engine.max_tokens_per_s, f"{decision.state.value}: rate cap"))
    coming = _coming(policy, decision, slo)
    if coming is not None:
        state, why = coming
        profile = policy.states[state]
        threads = min(threads, profile.thread_limit)
        if profile.max_tokens_per_s is not None:
            caps.append((profile.max_tokens_per_s, f"{why}: {state.value} rate cap"))
    decode = _scaled(measured.decode_tokens_per_s, measured.decode_threads, threads)
    rate, rate_why = (decode, "measured decode") if decode is not None else (None, "")
    for cap, why in caps:
        if rate is None or cap < rate:
            rate, rate_why = cap, why
    prefill = _scaled(measured.prefill_tokens_per_s, measured.prefill_threads, threads)
    ttft = None if prompt_tokens is None or prefill is None else prompt_tokens / prefill
    n_ctx = decision.engine.n_ctx
    if prompt_tokens is not None and prompt_tokens >= n_ctx:
        why = f"the prompt (~{prompt_tokens} tokens) does not fit the device's context (n_ctx {n_ctx})"
        return Prediction(False, rate, ttft, why, "context")  # the engine would drop earlier messages
    if targets.min_tokens_per_s is not None and rate is not None:
        need = targets.min_tokens_per_s * (1 + margin)
        if rate < need:
            return Prediction(False, rate, ttft, f"{rate_why} {_n(rate)} tok/s < target {_n(need)} tok/s", "rate")
    if targets.max_ttft_s is not None and ttft is not None:
        limit = targets.max_ttft_s * (1 - margin)
        if ttft > limit:
            return Prediction(
                False,
                rate,
                ttft,
                f"predicted TTFT {_n(ttft)} s ({prompt_tokens} prompt tokens at {_n(prefill or 0)} tok/s) "
                f"> target {_n(limit)} s",
                "ttft",
            )
    return Prediction(True, rate, ttft, "meets the targets" if rate is not None else "no local measurement yet")


class RouteGate:
    """The device-wide half of the routing decision, with hysteresis: `off` (send requests away) as soon as the
    prediction misses; back once it meets the targets with `back_margin` to spare for `back_after_s`."""

    def __init__(self) -> None:
        self.off = False
        self.reason = "meets the targets"
        self._good_since: float | None = None

    def update(self, t: float, slo: Slo, strict: Prediction, with_margin: Prediction) -> bool:
        if not self.off:
            if not strict.meets:
                self.off, self.reason, self._good_since = True, strict.reason, None
            else:
                self.reason = strict.reason
            return self.off
        if not with_margin.meets:
            self._good_since = None
            self.reason = with_margin.reason
            return True
        if self._good_since is None:
            self._good_since = t
        if t - self._good_since >= slo.back_after_s:
            self.off, self.reason = False, f"back: {with_margin.reason} for {slo.back_after_s:g} s"
        else:
            left = slo.back_after_s - (t - self._good_since)
            self.reason = f"recovering: meets the targets with {slo.back_margin:.0%} margin, back in {left:.0f} s"
        return self.off
