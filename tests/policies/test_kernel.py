"""Hot yields to the kernel's clock steps (rule `thermal.kernel`, policies/hot.py `_kernel`): on alike cores whose clock
the daemon cannot set, hot's threads and rate cap at the full clock buy tokens linearly in watts, where the kernel's
lower clock on every thread buys them at f^(1-k) of the watts. Issue 27's randomized fleet: such devices got 0.30-0.67
x the ungoverned engine's tokens at up to 3.2 x its J/token (fleet:2:137, 2:158, 2:135)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from policies.decision import Decision, State
from policies.loader import load_policy
from policies.machine import StateMachine
from policies.schema import Policy
from sensors.snapshot import Cpu, EngineObservation
from tests.policies.builders import snap

TRIPS = [("passive", 60.0), ("critical", 75.0)]  # `default`: hot's setpoint 58 °C, critical from 70 °C


def compute_bound(threads: int) -> float:
    return 5.0 * threads


def run(
    seconds: int, *, temp_c: float = 58.8, speed: Callable[[int], float] = compute_bound,
    throttled: bool | None = False, policy: Policy | None = None, gov: StateMachine | None = None,
) -> list[Decision]:  # fmt: skip
    """`default` (or `policy`) on a 4-core box whose clock cannot be set, its zone held at `temp_c`, driving an engine
    that decodes `speed(threads)` up to the rate cap."""
    gov = gov or StateMachine(policy or load_policy("default"))
    zone = snap(temp_c, trips=TRIPS)
    cpu = Cpu(freq_ratio=None if throttled is None else 1.0, throttled=throttled, count=4, other_cores=0.05)
    threads, rate = 4, None
    start = int(gov.last.t) + 1 if gov.last is not None else 0
    out: list[Decision] = []
    for t in range(start, start + seconds):
        tok = speed(threads) if rate is None else min(speed(threads), rate)
        engine = EngineObservation(busy=True, tokens_per_s=tok, model="m", threads=threads)
        decision = gov.decide(zone.model_copy(update={"cpu": cpu}), engine, float(t))
        threads, rate = decision.engine.threads, decision.engine.max_tokens_per_s
        out.append(decision)
    return out


def changes(seen: list[Decision]) -> int:
    return sum(1 for a, b in itertools.pairwise(seen) if a.engine != b.engine)


def test_a_compute_bound_engine_runs_every_thread_and_the_kernel_keeps_the_trip() -> None:
    gov = StateMachine(load_policy("default"))
    cut = run(60, gov=gov)  # over the setpoint: the PI cuts, and the cut is predicted to lose
    at_trip = run(300, temp_c=60.5, throttled=True, gov=gov)  # the kernel throttles and holds the zone at its trip
    yielded = next(i for i, d in enumerate(cut) if d.rule == "thermal.kernel")
    assert all(d.rule == "thermal.kernel" for d in cut[yielded:] + at_trip)
    assert all(d.state == State.HOT for d in at_trip)
    assert all((d.engine.threads, d.engine.max_tokens_per_s) == (4, None) for d in at_trip)  # as ungoverned
    assert "pass-through: hot's limits" in at_trip[-1].reason
    assert "predicted ungoverned" in at_trip[-1].reason
    assert changes(cut[yielded:] + at_trip) <= 1  # the cut's lift, once the change dwell allows


def test_hots_limits_return_once_the_kernel_has_not_throttled_for_the_backoff() -> None:
    gov = StateMachine(load_policy("default"))
    run(60, gov=gov)
    run(60, temp_c=60.5, throttled=True, gov=gov)
    calm = run(200, temp_c=58.8, gov=gov)  # under the trip, the kernel lets go
    back = next(i for i, d in enumerate(calm) if d.rule != "thermal.kernel")
    assert back >= 119
    assert calm[back].rule == "thermal.pi"


def test_where_the_clock_says_nothing_or_the_policy_names_its_own_trip_hot_governs() -> None:
    """No cpufreq to tell when the kernel throttles, or a trip the user set under the device's (a loss asked for)."""
    unknown = run(300, throttled=None)
    own_trip = run(300, policy=load_policy("default").model_copy(update={"thermal": _own_trip(60.0)}))
    for seen in (unknown, own_trip):
        assert all(d.rule != "thermal.kernel" for d in seen)
        assert seen[-1].engine.threads < 4 or seen[-1].engine.max_tokens_per_s is not None


def _own_trip(trip_c: float) -> object:
    thermal = load_policy("default").thermal
    return thermal.model_copy(update={"trip_c": trip_c})


def test_where_the_kernels_lowest_clock_cannot_hold_the_trip_a_rate_cap_keeps_critical_away() -> None:
    """Every thread at the kernel's lowest clock can still heat the zone past its trip: a PI over the trip (1.5 °C under
    critical's threshold here) caps the rate on every thread, and lifts it when the zone is back."""
    gov = StateMachine(load_policy("default"))
    run(300, gov=gov)
    over = run(120, temp_c=69.5, gov=gov)
    assert over[-1].state == State.HOT
    assert over[-1].rule == "thermal.kernel"
    assert over[-1].engine.threads == 4
    assert over[-1].engine.max_tokens_per_s is not None
    assert "a rate cap on every thread" in over[-1].reason
    back = run(300, temp_c=61.0, gov=gov)
    assert back[-1].engine.max_tokens_per_s is None
