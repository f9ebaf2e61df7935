"""Hot steps aside where the heat is not the engine's (policies/authority.py): at its floor, with the kernel
throttling and the zone not falling, the cut only loses tokens; where the cut works, or the kernel does not throttle,
hot keeps governing."""

from __future__ import annotations

from itertools import pairwise

from policies import StateMachine
from policies.authority import BACKOFF_S, WINDOW_S, Authority
from policies.decision import Decision, State
from sensors.snapshot import Cpu, Snapshot
from tests.policies.builders import BUSY, snap
from tests.policies.conftest import make_policy

POLICY = make_policy()  # trip 80 °C, hot from 75 °C, setpoint 78 °C, hot's rate cap 2..10 tok/s


def hot_snap(temp_c: float, *, throttled: bool) -> Snapshot:
    cpu = Cpu(freq_ratio=0.5 if throttled else 1.0, throttled=throttled, count=4)
    return snap(temp_c, trips=[("passive", 80.0), ("critical", 100.0)]).model_copy(update={"cpu": cpu})


def play(gov: StateMachine, temps: list[float], *, throttled: bool, t0: float = 0.0, dt: float = 1.0) -> list[Decision]:
    return [gov.decide(hot_snap(c, throttled=throttled), BUSY, t0 + i * dt) for i, c in enumerate(temps)]


def test_others_heat_over_the_trip_with_the_kernel_throttling_lifts_hots_floor() -> None:
    gov = StateMachine(POLICY)
    out = play(gov, [82.0] * 400, throttled=True)
    floor = next(i for i, d in enumerate(out) if d.state == State.HOT and d.engine.max_tokens_per_s == 2.0)
    aside = next(i for i, d in enumerate(out) if d.rule == "thermal.aside")
    assert aside - floor >= WINDOW_S - 1  # a window at the floor first
    assert out[aside].engine.threads == 4  # as ungoverned at once: one change, not a ramp of one per recover step
    last = out[-1]
    assert last.state == State.HOT
    assert last.engine.max_tokens_per_s is None
    assert last.engine.threads == 4
    assert "pass-through" in last.reason
    assert "not the engine's to govern" in last.reason


def test_a_zone_that_falls_at_the_floor_keeps_hot_governing() -> None:
    gov = StateMachine(POLICY)
    temps = [82.0] * 12 + [82.0 - 0.02 * i for i in range(150)]  # at the floor the cut works: 1.2 °C a minute
    out = play(gov, temps, throttled=True)
    assert all(d.rule != "thermal.aside" for d in out)
    assert out[-1].engine.max_tokens_per_s == 2.0


def test_without_the_kernel_throttling_hot_keeps_its_floor() -> None:
    gov = StateMachine(POLICY)
    out = play(gov, [82.0] * 400, throttled=False)
    assert all(d.rule != "thermal.aside" for d in out)
    assert out[-1].engine.max_tokens_per_s == 2.0


def test_back_after_the_kernel_stopped_throttling_for_the_backoff_which_then_doubles() -> None:
    a = Authority()
    t = 0.0
    for _ in range(int(WINDOW_S) + 1):
        t += 1.0
        a.aside(t, hot=True, u=0.0, throttled=True, temp_c=50.0)
    assert a.back_after_s == BACKOFF_S
    calm = t
    while a.aside(t, hot=True, u=None, throttled=False, temp_c=48.0):
        t += 1.0
    assert t - calm >= BACKOFF_S
    assert a.back_after_s is None
    assert a.backoff_s == 2 * BACKOFF_S
    a.aside(t + 1, hot=False, u=None, throttled=False, temp_c=40.0)  # out of hot: the back-off starts over
    assert a.backoff_s == BACKOFF_S


def test_in_critical_for_memory_alone_the_heat_is_still_hots_to_govern() -> None:
    gov = StateMachine(POLICY)
    cpu = Cpu(freq_ratio=1.0, throttled=False, count=4)
    low = snap(79.5, trips=[("passive", 80.0), ("critical", 100.0)], available_mb=80).model_copy(update={"cpu": cpu})
    out = [gov.decide(low, BUSY, float(i)) for i in range(30)]
    assert out[-1].state == State.CRITICAL
    assert out[-1].engine.threads < 4  # hot's cut: 0.5 °C under the trip, the engine does not run unlimited into it
    assert out[-1].engine.max_tokens_per_s is not None


def test_in_critical_for_memory_alone_the_pis_next_decimal_is_not_a_change_per_tick() -> None:
    # hot's PI drifts the rate cap a decimal a tick over the setpoint; critical made each one urgent (fleet:2:181: 44
    # config changes a minute). A step of RATE_STEP either way, or a thread, still goes at once.
    gov = StateMachine(make_policy(changes={"enabled": True}))
    cpu = Cpu(freq_ratio=1.0, throttled=False, count=4)
    trips = [("passive", 80.0), ("critical", 100.0)]
    out = [
        gov.decide(snap(78.8, trips=trips, available_mb=80).model_copy(update={"cpu": cpu}), BUSY, i * 0.5)
        for i in range(480)
    ]
    assert all(d.state == State.CRITICAL for d in out[10:])
    capped = [d.engine.max_tokens_per_s for d in out if d.engine.max_tokens_per_s is not None]
    assert capped
    assert capped[-1] < capped[0]  # the PI still governs the heat
    changes = sum(a.engine != b.engine for a, b in pairwise(out[10:]))
    assert changes <= 240 / 30 + 4  # about one per live dwell (and the steps), not one per tick
