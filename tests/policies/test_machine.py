"""One test per rule of the state machine, driven by snapshots built from the sensor types."""

from __future__ import annotations

import itertools
from pathlib import Path

from policies import StateMachine
from policies.decision import Hold, State
from policies.ladder import ModelLadder, ModelTier
from policies.schema import Policy
from sensors.snapshot import Cpu, EngineObservation, Snapshot, Temperature
from tests.policies.builders import BUSY, IDLE, run, snap, states
from tests.policies.conftest import make_policy


def heat_to_hot(gov: StateMachine, t0: float = 0.0) -> float:
    """Drive the governor into hot with a steady 80 °C reading; returns the next free time."""
    decisions = run(gov, [snap(80.0)] * 3, t0=t0)
    assert decisions[-1].state == State.HOT
    return t0 + 3


def test_idle_until_the_engine_is_busy_then_sustained(policy: Policy) -> None:
    gov = StateMachine(policy)
    assert states(run(gov, [snap()] * 3, engine=IDLE)) == ["idle"] * 3
    busy = run(gov, [snap()] * 6, t0=3, engine=BUSY)
    first = next(d for d in busy if d.state == State.SUSTAINED)
    assert first.rule == "activity.sustained"
    assert first.t == 8.0  # 5 busy seconds of a 10 s window = 0.5
    assert "engine busy 50 % of the last 10 s ≥ 50 %" in first.reason


def test_sustained_below_its_entry_says_so_without_contradiction(policy: Policy) -> None:
    """Held on by hysteresis at 40 % busy: the reason never reads "busy 40 % ≥ 50 %"."""
    gov = StateMachine(policy)
    run(gov, [snap()] * 11, engine=BUSY)
    decisions = run(gov, [snap()] * 7, t0=11, engine=IDLE)
    assert states(decisions) == ["sustained"] * 7
    reason = decisions[-1].reason
    assert "≥ 50 %" not in reason
    assert "until below 20 %" in reason


def test_sustained_falls_back_to_idle_only_after_the_dwell(policy: Policy) -> None:
    gov = StateMachine(policy)
    run(gov, [snap()] * 6, engine=BUSY)
    decisions = run(gov, [snap()] * 20, t0=6, engine=IDLE)
    back = next(d for d in decisions if d.state == State.IDLE)
    assert back.rule == "activity.idle"
    assert back.t >= 5 + policy.timing.recover_dwell_s


def test_forecast_enters_hot_before_the_reading(policy: Policy) -> None:
    gov = StateMachine(policy)
    ramp = [snap(65.0 + 0.5 * i) for i in range(20)]
    decisions = run(gov, ramp)
    hot = next(d for d in decisions if d.state == State.HOT)
    assert hot.rule == "thermal.forecast_enter"
    assert hot.readings["temp_c"] is not None
    assert float(hot.readings["temp_c"]) < 75.0
    assert "forecast" in hot.reason
    assert "in 10 s ≥ 75 °C" in hot.reason
    assert "threads 4→3" in hot.reason
    assert "rate cap" in hot.reason
    assert hot.engine.kv_type == "q8_0"
    assert hot.engine.n_ctx == 2048
    assert hot.changed


def test_a_steady_reading_below_the_entry_never_enters_hot(policy: Policy) -> None:
    gov = StateMachine(policy)
    assert set(states(run(gov, [snap(74.5)] * 60))) == {"sustained", "idle"}


def test_pi_lowers_threads_and_rate_while_over_the_setpoint(policy: Policy) -> None:
    gov = StateMachine(policy)
    t = heat_to_hot(gov)
    decisions = run(gov, [snap(82.0)] * 40, t0=t)
    assert all(d.state == State.HOT for d in decisions)
    assert decisions[1].rule == "thermal.pi"
    threads = [d.engine.threads for d in decisions]
    rates = [d.engine.max_tokens_per_s or 0 for d in decisions]
    assert threads == sorted(threads, reverse=True)
    assert rates == sorted(rates, reverse=True)
    assert (threads[-1], rates[-1]) == (1, 2.0)  # the hot profile's lower bounds
    assert "setpoint 78 °C" in decisions[-1].reason


def test_hot_holds_above_the_exit_and_leaves_below_it_after_debounce_and_dwell(policy: Policy) -> None:
    gov = StateMachine(policy)
    t = heat_to_hot(gov)
    assert states(run(gov, [snap(72.0)] * 15, t0=t)) == ["hot"] * 15  # 72 > exit 71
    decisions = run(gov, [snap(70.0)] * 10, t0=t + 15)
    left = next(d for d in decisions if d.state != State.HOT)
    assert left.rule == "thermal.exit"
    assert "70.0 °C < 71 °C" in left.reason
    assert left.t >= t + 15 + policy.thermal.exit_debounce_s


def test_dwell_holds_a_wanted_change_and_says_so(policy: Policy) -> None:
    gov = StateMachine(policy)
    heat_to_hot(gov)  # hot entered at t=1
    held = run(gov, [snap(60.0)] * 6, t0=3)
    assert all(d.state == State.HOT for d in held)
    waiting = [d for d in held if d.rule == "dwell.hold"]
    assert waiting
    assert "(dwell)" in waiting[0].reason


def test_threads_come_back_one_step_per_recover_step(policy: Policy) -> None:
    gov = StateMachine(policy)
    t = heat_to_hot(gov)
    before = run(gov, [snap(84.0)] * 30, t0=t)  # PI down to 1 thread
    assert before[-1].engine.threads == 1
    decisions = [before[-1], *run(gov, [snap(60.0)] * 40, t0=t + 30)]
    assert any(d.rule == "thermal.exit" for d in decisions)
    steps = [d for prev, d in itertools.pairwise(decisions) if d.engine.threads != prev.engine.threads]
    assert [d.engine.threads for d in steps] == [2, 3, 4]  # one at a time, never down again
    gaps = [b.t - a.t for a, b in itertools.pairwise(steps)]
    assert all(gap >= policy.timing.recover_step_s for gap in gaps)
    assert steps[-1].rule == "recover.step"
    assert steps[-2].engine.max_tokens_per_s is not None  # the cap lifts only once threads are back
    assert decisions[-1].engine.max_tokens_per_s is None


def test_critical_is_immediate_even_inside_the_dwell(policy: Policy) -> None:
    gov = StateMachine(policy)
    heat_to_hot(gov)  # hot since t=1
    decisions = run(gov, [snap(91.0)] * 2, t0=3, dt=0.5)
    assert decisions[-1].state == State.CRITICAL
    crit = decisions[-1]
    assert crit.rule == "thermal.critical"
    assert "91.0 °C ≥ critical 90 °C" in crit.reason
    assert (crit.engine.threads, crit.engine.n_ctx, crit.engine.kv_type) == (1, 512, "q4_0")
    assert crit.engine.model == "smallest"


def test_thresholds_default_to_the_lowest_passive_trip_of_trusted_zones() -> None:
    gov = StateMachine(make_policy(thermal={"trip_c": None, "critical_c": None}))
    nvme = Temperature(source="hwmon1/temp1", kind="hwmon", label="nvme", temp_c=50.0, trips=())
    s = snap(70.0, trips=[("passive", 85.0), ("passive", 95.0), ("critical", 105.0)], extra=[nvme])
    d = gov.decide(s, BUSY, 0.0)
    assert d.readings["trip_c"] == 85.0
    assert d.readings["hot_enter_c"] == 80.0
    assert d.readings["critical_c"] == 100.0  # critical trip - critical_margin_c
    assert d.readings["trip_source"] == "cpu-thermal passive trip"


def test_no_trip_anywhere_uses_the_policy_fallback() -> None:
    gov = StateMachine(make_policy(thermal={"trip_c": None}))
    d = gov.decide(snap(50.0), BUSY, 0.0)
    assert (d.readings["trip_c"], d.readings["trip_source"]) == (85.0, "fallback")


def test_untrusted_and_implausible_zones_are_ignored(policy: Policy) -> None:
    gov = StateMachine(policy)
    nvme = Temperature(source="hwmon1/temp1", kind="hwmon", label="nvme", temp_c=99.0)
    decisions = run(gov, [snap(140.0, extra=[nvme])] * 5)
    assert states(decisions)[-1] in {"idle", "sustained"}
    assert decisions[-1].readings["temp_c"] is None
    assert "temperature" in decisions[-1].reason
    assert "unknown" in decisions[-1].reason


def test_battery_temperature_counts_when_the_policy_trusts_it() -> None:
    gov = StateMachine(make_policy(thermal={"zones": ["skin*"], "use_battery_temp": True}))
    d = gov.decide(snap(None, percent=80, plugged=False, battery_temp_c=41.5), BUSY, 0.0)
    assert (d.readings["temp_c"], d.readings["zone"]) == (41.5, "battery")


def test_low_battery_on_discharge_with_hysteresis(policy: Policy) -> None:
    gov = StateMachine(policy)
    run(gov, [snap(percent=30, plugged=False)] * 2, engine=IDLE)
    decisions = run(gov, [snap(percent=20, plugged=False)] * 4, t0=2, engine=IDLE)
    low = next(d for d in decisions if d.state == State.LOW_BATTERY)
    assert low.rule == "battery.low"
    assert low.t == 4.0  # after the 2 s debounce
    assert "battery 20 % ≤ 20 % on battery power" in low.reason
    assert (low.engine.threads, low.engine.max_tokens_per_s) == (2, 6.0)
    # 24 % is inside the hysteresis band: stays low
    assert set(states(run(gov, [snap(percent=24, plugged=False)] * 20, t0=6, engine=IDLE))) == {"low_battery"}
    up = run(gov, [snap(percent=26, plugged=False)] * 5, t0=26, engine=IDLE)
    assert up[-1].state == State.IDLE
    assert next(d for d in up if d.state == State.IDLE).rule == "battery.recovered"


def test_plugging_in_leaves_low_battery_after_the_debounce(policy: Policy) -> None:
    gov = StateMachine(policy)
    run(gov, [snap(percent=15, plugged=False)] * 15, engine=IDLE)
    decisions = run(gov, [snap(percent=15, plugged=True, charging=True)] * 5, t0=15, engine=IDLE)
    assert decisions[0].state == State.LOW_BATTERY
    back = next(d for d in decisions if d.state != State.LOW_BATTERY)
    assert back.rule == "battery.plugged"
    assert back.t == 17.0
    assert "on external power at 15 %" in back.reason


def test_unplugged_battery_at_critical_level_is_critical(policy: Policy) -> None:
    gov = StateMachine(policy)
    decisions = run(gov, [snap(percent=4, plugged=False)] * 3, engine=IDLE)
    crit = next(d for d in decisions if d.state == State.CRITICAL)
    assert crit.rule == "battery.critical"
    assert "battery 4 % ≤ 5 % on battery power" in crit.reason


def test_memory_below_the_floor_is_critical(policy: Policy) -> None:
    gov = StateMachine(policy)
    decisions = run(gov, [snap(available_mb=80)] * 3, engine=IDLE)
    crit = next(d for d in decisions if d.state == State.CRITICAL)
    assert crit.rule == "memory.floor"
    assert "80 MiB available < floor 100 MiB" in crit.reason


def test_critical_for_memory_alone_keeps_the_threads_through_its_dwell(policy: Policy) -> None:
    """Memory back, critical's dwell holds the state, and what it was for holds with it: the critical profile's memory
    (context), not its 1 thread at 1 tok/s and the threads' one-a-step return after it (a phone's squeeze lost 30 % of
    `none`'s tokens to that). Critical for heat keeps its one thread through the dwell."""
    gov = StateMachine(policy)
    run(gov, [snap()] * 12, engine=BUSY)
    low = run(gov, [snap(available_mb=80)] * 4, t0=12, engine=BUSY)
    back = run(gov, [snap()] * 12, t0=16, engine=BUSY)
    assert states(back)[:2] == ["critical"] * 2
    assert states(back)[-1] == "sustained"
    assert {(d.engine.threads, d.engine.max_tokens_per_s) for d in low + back} == {(4, None)}
    assert (low[-1].engine.n_ctx, back[-1].engine.n_ctx) == (512, 4096)
    heat = StateMachine(policy)
    run(heat, [snap()] * 12, engine=BUSY)
    run(heat, [snap(91.0)] * 2, t0=12, engine=BUSY)
    cooling = run(heat, [snap(60.0)] * 3, t0=14, engine=BUSY)
    assert states(cooling) == ["critical"] * 3
    assert cooling[-1].engine.threads == 1


def test_memory_pressure_shrinks_context_step_by_step_without_a_ladder(policy: Policy) -> None:
    gov = StateMachine(policy)
    run(gov, [snap(psi=0.0)] * 2, engine=IDLE)
    decisions = run(gov, [snap(psi=25.0)] * 12, t0=2, engine=IDLE)
    assert decisions[0].rule == "memory.pressure"
    assert [d.engine.n_ctx for d in decisions[:1]] == [2048]
    assert min(d.engine.n_ctx for d in decisions) == 512  # three shrinks, 5 s apart, floor min_ctx
    assert "memory pressure 25 %" in decisions[0].reason
    calm = run(gov, [snap(psi=0.5)] * 15, t0=14, engine=IDLE)
    assert calm[0].engine.n_ctx == 512  # held for the exit debounce
    assert calm[-1].engine.n_ctx == 4096


def test_a_hold_pins_a_profile_but_not_over_hot(policy: Policy) -> None:
    gov = StateMachine(make_policy(states={"sustained": {"threads": 2}}))
    pin = (Hold(owner="chat", state=State.IDLE),)
    decisions = run(gov, [snap()] * 8, holds=pin)
    assert decisions[-1].state == State.IDLE
    assert decisions[-1].engine.threads == 4
    assert decisions[-1].rule == "hold.pin"
    hot = run(gov, [snap(80.0)] * 3, t0=8, holds=pin)
    assert hot[-1].state == State.HOT
    assert hot[-1].engine.threads <= 3


def test_a_pin_overrides_low_battery(policy: Policy) -> None:
    gov = StateMachine(policy)
    pin = (Hold(owner="chat", state=State.IDLE),)
    d = run(gov, [snap(percent=15, plugged=False)] * 5, holds=pin, engine=IDLE)[-1]
    assert d.state == State.IDLE
    assert d.engine.threads == 4


def test_caps_always_apply_and_expired_holds_do_not(policy: Policy) -> None:
    gov = StateMachine(policy)
    holds = (Hold(owner="a", max_threads=2, max_tokens_per_s=3.0), Hold(owner="b", max_threads=1, expires_t=1.5))
    decisions = run(gov, [snap()] * 4, holds=holds, engine=IDLE)
    assert decisions[0].engine.threads == 1
    assert decisions[-1].engine.threads == 1  # going up waits for the recover step
    assert decisions[-1].engine.max_tokens_per_s == 3.0
    later = run(gov, [snap()] * 8, t0=4, holds=holds, engine=IDLE)
    assert later[-1].engine.threads == 2


def test_a_hold_caps_the_model_tier_and_context_and_the_reason_names_it(policy: Policy) -> None:
    """The daemon's supervisor caps the engine after a memory kill with such a hold: the decision is what runs."""
    ladder = ModelLadder(
        tier=tuple(ModelTier(name=n, path=Path(f"{n}.gguf"), n_ctx=4096) for n in ("large", "medium", "small"))
    )
    gov = StateMachine(policy, ladder=ladder)
    free = gov.decide(snap(), IDLE, 0.0)
    assert (free.engine.model, "capped" in free.reason) == ("large", False)
    cap = Hold(owner="SIGKILL under memory pressure: large/4096", max_tier="medium", max_ctx=1024)
    capped = gov.decide(snap(), IDLE, 1.0, (cap,))
    assert (capped.engine.model, capped.engine.n_ctx) == ("medium", 1024)
    assert capped.rule == "hold.cap"
    assert "capped at medium/n_ctx 1024 (SIGKILL under memory pressure: large/4096)" in capped.reason
    assert gov.decide(snap(), IDLE, 2.0, (cap.model_copy(update={"max_tier": "large"}),)).engine.model == "large"
    assert gov.decide(snap(), IDLE, 3.0, (Hold(owner="x", max_tier="huge"),)).engine.model == "large"  # no such tier


def test_an_engine_given_up_is_critical_at_once_and_the_reason_is_why(policy: Policy) -> None:
    gov = StateMachine(policy)
    run(gov, [snap()] * 3, engine=IDLE)
    why = "engine failed 5 times in a row, last: engine exited with status 1 after 0.4 s"
    d = gov.decide(snap(), EngineObservation(busy=False, given_up=why), 3.0)
    assert (d.state, d.rule) == (State.CRITICAL, "supervisor.given_up")
    assert d.reason.startswith(f"critical: {why}; ")
    assert d.engine.n_ctx <= policy.states[State.CRITICAL].n_ctx  # critical's limits, as for any critical cause


def test_threads_never_exceed_the_online_cpus(policy: Policy) -> None:
    gov = StateMachine(policy)
    two_cpus = snap().model_copy(update={"cpu": Cpu(freq_ratio=None, throttled=None, count=2)})
    full = StateMachine(policy).decide(snap(), IDLE, 0.0).engine.threads  # CPU count unknown: no cap
    assert full > 2
    assert gov.decide(two_cpus, IDLE, 0.0).engine.threads == 2


def test_missing_readings_never_crash_and_are_named(policy: Policy) -> None:
    gov = StateMachine(policy)
    empty = snap(None, available_mb=None, percent=None, plugged=None)
    d = gov.decide(empty, None, 0.0)
    assert d.state == State.IDLE
    assert "temperature, engine activity unknown" in d.reason
    nobatt = snap(50.0, plugged=True, percent=None)
    assert "battery level" in gov.decide(nobatt, BUSY, 1.0).reason


def test_an_unknown_temperature_keeps_hot(policy: Policy) -> None:
    gov = StateMachine(policy)
    t = heat_to_hot(gov)
    decisions = run(gov, [snap(None)] * 20, t0=t)
    assert states(decisions) == ["hot"] * 20
    assert "temperature unknown" in decisions[-1].reason


def test_interval_is_short_while_mitigating_or_deciding(policy: Policy) -> None:
    gov = StateMachine(policy)
    watchful = gov.decide(snap(70.0), IDLE, 0.0)  # idle, but within calm_margin_c of hot entry (75 °C)
    assert gov.interval_s(watchful) == 1.0
    pending = gov.decide(snap(80.0), IDLE, 1.0)  # hot is debouncing
    assert pending.state == State.IDLE
    assert gov.interval_s(pending) == 0.25
    hot = gov.decide(snap(80.0), IDLE, 2.0)
    assert hot.state == State.HOT
    assert gov.interval_s(hot) == 0.25


def test_changed_marks_only_engine_config_changes(policy: Policy) -> None:
    gov = StateMachine(policy)
    decisions = run(gov, [snap(50.0)] * 3 + [snap(76.0)] * 3)  # under the setpoint: PI stays at its top
    assert [d.changed for d in decisions] == [True, False, False, False, True, False]


def test_kernel_throttling_is_named_while_hot(policy: Policy) -> None:
    from sensors.snapshot import Cpu

    gov = StateMachine(policy)
    throttled = snap(80.0).model_copy(update={"cpu": Cpu(freq_ratio=0.6, throttled=True)})
    d = run(gov, [throttled] * 3)[-1]
    assert d.state == State.HOT
    assert d.readings["cpu_throttled"] is True
    assert "already throttled by the kernel" in d.reason


def test_calm_ticks_slowly_and_anything_near_a_threshold_ends_calm(policy: Policy) -> None:
    """thermald's slow poll: an idle engine far from every threshold is looked at every calm_interval_s."""
    calm_s = policy.timing.calm_interval_s
    assert calm_s > policy.timing.interval_s

    def interval(snapshot: Snapshot, engine: EngineObservation | None = IDLE, *, warm_up: int = 1) -> float:
        gov = StateMachine(policy)
        decisions = run(gov, [snapshot] * warm_up, engine=engine)
        return gov.interval_s(decisions[-1])

    assert interval(snap(50.0)) == calm_s
    assert interval(snap(None)) == calm_s  # no temperature at all: nothing thermal can fire
    assert interval(snap(50.0, percent=60.0, plugged=False)) == calm_s
    assert interval(snap(50.0), BUSY) == 1.0  # generating
    assert interval(snap(50.0), None) == 1.0  # the engine is not known (starting, or gone)
    assert interval(snap(66.0)) == 1.0  # 9 °C from hot entry, within calm_margin_c
    assert interval(snap(50.0, percent=30.0, plugged=True)) == 1.0  # unplugging would make it low_battery soon
    assert interval(snap(50.0, psi=3.0)) == 1.0  # memory pressure building (at or above psi_exit)
    assert interval(snap(50.0, available_mb=250.0)) == 1.0  # close to the memory floor

    # A rising forecast ends calm before the reading gets near: 50 -> 62 °C in 12 s forecasts past 65 °C.
    gov = StateMachine(policy)
    rising = run(gov, [snap(50.0 + i) for i in range(13)], engine=IDLE)
    forecast = rising[-1].readings["forecast_c"]
    assert isinstance(forecast, float)
    assert forecast > 65.0
    assert gov.interval_s(rising[-1]) == 1.0


def test_calm_never_makes_the_loop_slower_than_its_interval(policy: Policy) -> None:
    slow = policy.model_copy(update={"timing": policy.timing.model_copy(update={"interval_s": 8.0})})
    gov = StateMachine(slow)
    assert gov.interval_s(gov.decide(snap(50.0), IDLE, 0.0)) == 8.0


def test_an_unchanged_config_is_one_object_and_any_change_is_a_new_one(policy: Policy) -> None:
    """The engine config is built once per distinct value (a cache keyed by every field): a hold that changes one
    setting gives a new config with it, and going back gives the first one again."""
    gov = StateMachine(policy)
    capped = Hold(owner="t", max_tokens_per_s=5.0)
    first, same = run(gov, [snap()] * 2, engine=IDLE)
    assert same.engine is first.engine
    assert not same.changed
    lower = run(gov, [snap()], t0=2, engine=IDLE, holds=[capped])[0]
    assert lower.engine.max_tokens_per_s == 5.0
    assert lower.changed
    assert lower.engine is not first.engine
    slower = run(gov, [snap()], t0=3, engine=IDLE, holds=[capped.model_copy(update={"max_tokens_per_s": 4.0})])[0]
    assert slower.engine.max_tokens_per_s == 4.0
    assert slower.changed
    assert run(gov, [snap()], t0=4, engine=IDLE, holds=[capped])[0].engine is lower.engine
    # 5 == 5.0 as a dict key: the value's type is part of the key, so each config keeps exactly the value it was given.
    as_int = gov._config(2, 1024, kv="f16", model="m", rate=5, n_batch=512)
    as_float = gov._config(2, 1024, kv="f16", model="m", rate=5.0, n_batch=512)
    assert (repr(as_int.max_tokens_per_s), repr(as_float.max_tokens_per_s)) == ("5", "5.0")
    assert gov._config(2, 1024, kv="f16", model="m", rate=5.0, n_batch=512) is as_float


def test_a_decision_read_later_says_what_was_true_at_its_tick(policy: Policy) -> None:
    """The why is built when first read (status, `why`): by then the machine has moved on, and it must not show."""
    gov = StateMachine(policy)
    heat_to_hot(gov)
    first = gov.decide(snap(81.0), BUSY, 3.0)
    later = run(gov, [snap(78.0 + i) for i in range(6)], t0=4.0, engine=IDLE)
    assert later[-1].readings["temp_c"] == 83.0
    assert (first.readings["temp_c"], first.readings["forecast_c"] is not None) == (81.0, True)
    assert first.reason.startswith("hot: cpu-thermal 81.0 °C")
    assert "83.0" not in first.reason
    assert first == first.model_copy()
    assert first != later[0]


def test_hot_caps_a_device_faster_than_its_top_rate_relative_to_the_measured_speed(policy: Policy) -> None:
    """The hot profile's rate range (2-10 tok/s) is for devices slower than its top: where the engine was measured
    decoding 22 tok/s, hot at a PI output of 1 leaves the rate alone (a 10 tok/s cap there took 55 % of its tokens
    before the zone was anywhere near its setpoint: fleet:2:16's long chat, 0.91 x `none`), and the cap falls with the
    PI output from the measured speed, through the rates above the profile's top, to its floor."""
    gov, threads, cap, seen = StateMachine(policy), 4, None, []
    for t, temp in enumerate([50.0] * 5 + [76.0] * 3 + [79.0] * 60):
        speed = 5.5 * threads if cap is None else min(5.5 * threads, cap)  # 22 tok/s on 4 threads
        decision = gov.decide(snap(temp), EngineObservation(busy=True, tokens_per_s=speed, threads=threads), float(t))
        threads, cap = decision.engine.threads, decision.engine.max_tokens_per_s
        seen.append(decision)
    entered = next(i for i, d in enumerate(seen) if d.state == State.HOT)
    assert seen[entered].engine.max_tokens_per_s is None  # u = 1: no cap
    caps = [d.engine.max_tokens_per_s for d in seen[entered:]]
    assert any(c is not None and c > 10.0 for c in caps)  # above the profile's top
    delivered = [min(5.5 * d.engine.threads, d.engine.max_tokens_per_s or 22.0) for d in seen[entered:]]
    assert delivered == sorted(delivered, reverse=True)  # each cut a cut, never more than the one before
    assert caps[-1] == 2.0
