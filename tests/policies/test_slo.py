"""The per-request prediction against the policy's [slo] and the way-back hysteresis (policies/slo.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policies.decision import Decision, EngineConfig, Outlook, State
from policies.schema import Slo
from policies.slo import Measured, RouteGate, predict
from tests.policies.conftest import make_policy


def decision(
    state: State = State.IDLE, *, threads: int = 4, cap: float | None = None, **outlook: float | bool | None
) -> Decision:
    engine = EngineConfig(threads=threads, n_ctx=1024, model="large", max_tokens_per_s=cap)
    return Decision(t=0.0, state=state, engine=engine, reason="", rule="", outlook=Outlook(**outlook))  # type: ignore[arg-type]


FAST = Measured(decode_tokens_per_s=20.0, decode_threads=4, prefill_tokens_per_s=200.0, prefill_threads=4)


def test_the_rate_cap_in_force_misses_the_decode_target() -> None:
    policy = make_policy(slo={"min_tokens_per_s": 8.0})
    assert predict(policy, decision(), FAST).meets
    hot = predict(policy, decision(State.HOT, threads=2, cap=5.0), FAST)
    assert not hot.meets
    assert hot.tokens_per_s == 5.0
    assert hot.reason == "hot: rate cap 5 tok/s < target 8 tok/s"


def test_fewer_threads_scale_the_measured_speed() -> None:
    policy = make_policy(slo={"min_tokens_per_s": 8.0})
    p = predict(policy, decision(State.HOT, threads=1), FAST)
    assert p.tokens_per_s == pytest.approx(5.0)
    assert not p.meets
    assert p.reason.startswith("measured decode 5 tok/s")


def test_a_forecast_of_hot_counts_the_hot_profile_already() -> None:
    policy = make_policy(slo={"min_tokens_per_s": 12.0})
    hot_cap = policy.states[State.HOT].max_tokens_per_s
    assert hot_cap is not None
    assert hot_cap < 12.0
    soon = predict(policy, decision(forecast_c=80.0, hot_enter_c=75.0), FAST)
    assert not soon.meets
    assert "forecast 80.0 °C ≥ hot entry 75.0 °C" in soon.reason
    assert predict(policy, decision(forecast_c=70.0, hot_enter_c=75.0), FAST).meets


def test_a_battery_about_to_cross_low_counts_the_low_battery_profile() -> None:
    policy = make_policy(slo={"min_tokens_per_s": 1000.0 - 1})
    low = policy.battery.low_percent
    near = predict(policy, decision(battery_percent=low + 1, on_power=False), Measured(5000.0, 4))
    assert not near.meets
    assert "about to cross low" in near.reason
    assert predict(policy, decision(battery_percent=low + 1, on_power=True), Measured(5000.0, 4)).meets


def test_a_long_prompt_misses_the_ttft_target_and_unknown_speeds_count_as_meeting() -> None:
    policy = make_policy(slo={"max_ttft_s": 2.0})
    assert predict(policy, decision(), FAST, prompt_tokens=100).meets  # 0.5 s
    long = predict(policy, decision(), FAST, prompt_tokens=1000)  # 5 s
    assert not long.meets
    assert long.ttft_s == pytest.approx(5.0)
    assert long.reason.startswith("predicted TTFT 5 s (1000 prompt tokens at 200 tok/s) > target 2 s")
    assert predict(policy, decision(), Measured(), prompt_tokens=1000).meets


def test_the_gate_leaves_at_once_and_comes_back_only_with_margin_for_back_after_s() -> None:
    policy = make_policy(slo={"min_tokens_per_s": 8.0, "back_margin": 0.25, "back_after_s": 10.0})
    gate = RouteGate()

    def tick(t: float, cap: float | None) -> bool:
        d = decision(State.HOT if cap else State.IDLE, cap=cap)
        strict = predict(policy, d, FAST)
        return gate.update(t, policy.slo, strict, predict(policy, d, FAST, margin=policy.slo.back_margin))

    assert not tick(0.0, None)
    assert tick(1.0, 5.0)
    assert "rate cap 5 tok/s" in gate.reason
    assert tick(2.0, 9.0)  # meets 8, but not with 25 % margin (10)
    assert tick(3.0, 12.0)
    assert gate.reason.startswith("recovering")
    assert tick(12.0, 12.0)
    assert tick(12.5, 9.0)  # the margin lost: the wait starts again
    assert tick(13.0, 12.0)
    assert not tick(23.0, 12.0)
    assert gate.reason.startswith("back:")


@pytest.mark.parametrize(
    "bad", [{"min_tokens_per_s": 0.0}, {"max_ttft_s": float("inf")}, {"max_ttft_s": -1.0}, {"back_margin": 2.0}]
)
def test_targets_are_finite_and_bounded(bad: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        Slo.model_validate(bad)


def test_a_prompt_longer_than_the_context_misses_whatever_the_targets() -> None:
    policy = make_policy()  # no targets
    assert predict(policy, decision(), FAST, prompt_tokens=1000).meets
    long = predict(policy, decision(), FAST, prompt_tokens=1024)
    assert not long.meets
    assert long.kind == "context"
    assert long.reason == "the prompt (~1024 tokens) does not fit the device's context (n_ctx 1024)"


def test_background_requests_are_judged_by_their_own_targets() -> None:
    policy = make_policy(slo={"min_tokens_per_s": 8.0, "background": {"min_tokens_per_s": 2.0}})
    hot = decision(State.HOT, threads=2, cap=5.0)
    assert not predict(policy, hot, FAST).meets
    assert predict(policy, hot, FAST, background=True).meets
    assert not predict(policy, decision(State.HOT, threads=2, cap=1.0), FAST, background=True).meets
