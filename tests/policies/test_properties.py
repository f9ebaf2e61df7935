"""Properties that hold for any trace (hypothesis): dwell, monotone response to heat, no flapping on noise."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from policies import StateMachine
from policies.decision import PRIORITY, Decision, State
from policies.ladder import ModelLadder, ModelTier
from policies.memfit import MIB, ModelFootprint
from policies.schema import Policy
from sensors.snapshot import EngineObservation, Snapshot
from tests.policies.builders import BUSY, snap
from tests.policies.conftest import make_policy

RANK = {s: i for i, s in enumerate(PRIORITY)}
POLICY = make_policy()

step = st.fixed_dictionaries(
    {
        "dt": st.floats(0.05, 4.0),
        "temp": st.one_of(st.none(), st.floats(20.0, 110.0)),
        "percent": st.one_of(st.none(), st.floats(0.0, 100.0)),
        "plugged": st.booleans(),
        "busy": st.booleans(),
        "psi": st.one_of(st.none(), st.floats(0.0, 40.0)),
        "available_mb": st.one_of(st.none(), st.floats(50.0, 4000.0)),
    }
)
traces = st.lists(step, min_size=1, max_size=80)
Step = dict[str, object]


def to_snapshot(s: Step, temp: float | None = None) -> Snapshot:
    return snap(
        s["temp"] if temp is None else temp,  # type: ignore[arg-type]
        trips=[("passive", 85.0), ("critical", 100.0)],
        percent=s["percent"],  # type: ignore[arg-type]
        plugged=s["plugged"],  # type: ignore[arg-type]
        psi=s["psi"],  # type: ignore[arg-type]
        available_mb=s["available_mb"],  # type: ignore[arg-type]
    )


def play(gov: StateMachine, trace: list[Step]) -> tuple[list[Decision], float]:
    t, out = 0.0, []
    for s in trace:
        t += float(s["dt"])  # type: ignore[arg-type]
        out.append(gov.decide(to_snapshot(s), EngineObservation(busy=bool(s["busy"])), t))
    return out, t


def _battery_step(percent: float, plugged: bool, dt: float) -> Step:
    return {"dt": dt, "temp": 50.0, "percent": percent, "plugged": plugged, "busy": False, "psi": None,
            "available_mb": 4000.0}  # fmt: skip


@settings(max_examples=150)
@given(traces)
@example([_battery_step(15.0, False, 1.0)] * 4 + [_battery_step(15.0, True, 1.5)] * 6)  # unplug, plug back quickly
def test_no_transition_sooner_than_the_dwell(trace: list[Step]) -> None:
    decisions, _ = play(StateMachine(POLICY), trace)
    timing = POLICY.timing
    changes = [(a, b) for a, b in itertools.pairwise(decisions) if a.state != b.state]
    entered = decisions[0].t
    for before, after in changes:
        since = after.t - entered
        if after.state != State.CRITICAL:
            assert since >= timing.min_dwell_s, (before.state, after.state, since)
        if RANK[after.state] > RANK[before.state]:  # back toward a less safe state
            assert since >= timing.recover_dwell_s, (before.state, after.state, since)
        entered = after.t


def check_monotone(
    gov: StateMachine, trace: list[Step], last: Step, cooler: float, hotter: float
) -> tuple[Decision, Decision]:
    """Same history, same time, same everything but the final temperature: the two decisions."""
    _, t = play(gov, trace)
    t += 1.0
    a, b = copy.deepcopy(gov), copy.deepcopy(gov)
    engine = EngineObservation(busy=bool(last["busy"]))
    cool = a.decide(to_snapshot(last, cooler), engine, t)
    hot = b.decide(to_snapshot(last, hotter), engine, t)
    assert hot.engine.threads <= cool.engine.threads, (cool.reason, hot.reason)
    assert RANK[hot.state] <= RANK[cool.state]  # at least as safe a state
    return cool, hot


temps = st.tuples(st.floats(20.0, 110.0), st.floats(20.0, 110.0)).map(sorted)


@settings(max_examples=150)
@given(traces, step, temps)
def test_a_hotter_reading_never_gives_more_threads_or_context(trace: list[Step], last: Step, pair: list[float]) -> None:
    cool, hot = check_monotone(StateMachine(POLICY), trace, last, pair[0], pair[1])
    assert hot.engine.n_ctx <= cool.engine.n_ctx


def footprint(file_mb: int, layers: int) -> ModelFootprint:
    return ModelFootprint(
        file_bytes=file_mb * MIB, n_layer=layers, n_embd=1024, n_head=8, n_head_kv=8, head_dim_k=128, head_dim_v=128,
        n_vocab=32000,
    )  # fmt: skip


LADDER = ModelLadder(
    tier=(
        ModelTier(name="big", path=Path("big.gguf"), n_ctx=8192),
        ModelTier(name="mid", path=Path("mid.gguf"), n_ctx=8192),
        ModelTier(name="tiny", path=Path("tiny.gguf"), n_ctx=4096),
    )
)
FOOTPRINTS = {"big": footprint(1500, 24), "mid": footprint(600, 16), "tiny": footprint(150, 8)}
TIER = {t.name: i for i, t in enumerate(LADDER.tiers)}


def _memory_step(dt: float, available_mb: float | None) -> Step:
    return {"dt": dt, "temp": None, "percent": None, "plugged": False, "busy": False, "psi": None,
            "available_mb": available_mb}  # fmt: skip


@settings(max_examples=100)
@given(traces, step, temps)
# No zone reads for 5.75 s (hot on: untrusted), memory unknown (the largest tier), then 1 GiB: the exit band shrinks
# to tiny@4096 and the enter band keeps it while cool; hot's profile caps n_ctx and KV, and the fit under that cap
# found mid@512 q4_0 (a bigger tier when hotter).
@example(
    [_memory_step(dt, None) for dt in (1.0, 2.0, 2.0, 0.5, 0.25)] + [_memory_step(1.0, 1024.0)],
    _memory_step(1.0, 1024.0),
    [20.0, 75.0],
)
def test_with_memory_fit_hotter_never_gives_a_bigger_tier_or_context_on_one_tier(
    trace: list[Step], last: Step, pair: list[float]
) -> None:
    gov = StateMachine(POLICY, ladder=LADDER, footprints=FOOTPRINTS)
    cool, hot = check_monotone(gov, trace, last, pair[0], pair[1])
    assert TIER[hot.engine.model] >= TIER[cool.engine.model]
    if hot.engine.model == cool.engine.model:
        assert hot.engine.n_ctx <= cool.engine.n_ctx


def count_changes(decisions: list[Decision]) -> int:
    return sum(a.state != b.state for a, b in itertools.pairwise(decisions))


noise = st.lists(st.tuples(st.floats(0.1, 2.0), st.floats(-1.0, 1.0)), min_size=10, max_size=150)


@settings(max_examples=150)
@given(noise, st.floats(0.0, 0.95))
def test_noise_around_the_hot_threshold_does_not_flap(samples: list[tuple[float, float]], scale: float) -> None:
    policy: Policy = POLICY
    amplitude = scale * policy.thermal.hysteresis_c / 2  # anything under half the hysteresis band
    enter = 80.0 - policy.thermal.hot_margin_c
    gov, t, out = StateMachine(policy), 0.0, []
    for dt, u in samples:
        t += dt
        out.append(gov.decide(snap(enter + u * amplitude), BUSY, t))
    hot = [d.state == State.HOT for d in out]
    assert count_changes(out) <= 2  # idle -> sustained -> hot at most, never back
    if True in hot:
        assert all(hot[hot.index(True) :])


@settings(max_examples=150)
@given(noise, st.floats(0.0, 0.95))
def test_battery_noise_around_the_low_threshold_does_not_flap(samples: list[tuple[float, float]], scale: float) -> None:
    bat = POLICY.battery
    amplitude = scale * bat.hysteresis_percent / 2
    gov, t, out = StateMachine(POLICY), 0.0, []
    for dt, u in samples:
        t += dt
        out.append(gov.decide(snap(50.0, percent=bat.low_percent + u * amplitude, plugged=False), None, t))
    low = [d.state == State.LOW_BATTERY for d in out]
    assert count_changes(out) <= 1
    if True in low:
        assert all(low[low.index(True) :])


@settings(max_examples=150)
@given(noise, st.floats(0.0, 0.95))
def test_noise_around_the_hot_exit_does_not_flap(samples: list[tuple[float, float]], scale: float) -> None:
    amplitude = scale * POLICY.thermal.hysteresis_c / 2
    exit_c = 80.0 - POLICY.thermal.hot_margin_c - POLICY.thermal.hysteresis_c
    gov, t = StateMachine(POLICY), 0.0
    for _ in range(5):
        gov.decide(snap(80.0), BUSY, t)
        t += 1.0
    assert gov.state == State.HOT
    out = []
    for dt, u in samples:
        t += dt
        out.append(gov.decide(snap(exit_c + u * amplitude), BUSY, t))
    assert count_changes(out) <= 1  # leaves hot at most once, never comes back


@settings(max_examples=50)
@given(traces)
def test_same_inputs_same_decisions(trace: list[Step]) -> None:
    first, _ = play(StateMachine(POLICY), trace)
    second, _ = play(StateMachine(POLICY), trace)
    assert [d.model_dump() for d in first] == [d.model_dump() for d in second]
