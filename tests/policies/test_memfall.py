"""Memory falling over a minute (other programs allocating): the shrink goes where memory is going, in one step, and a
model switch is made once per fall (issue 27: "a model switch at most once per 5 minutes unless a kill is imminent").

The shipped `default` policy in a closed loop: the engine takes what its setting needs, other programs take the rest
of the room along a ramp (the lab's `memory-squeeze-1g`: down to 900 MiB for the engine over 60 s)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

from policies.decision import Decision, EngineConfig
from policies.ladder import ModelLadder, ModelTier
from policies.loader import load_policy
from policies.machine import StateMachine
from sensors.snapshot import EngineObservation
from tests.policies.test_changes import footprint, memory

MIB = 1 << 20


def governor(*names: str, n_ctx: int = 4096) -> StateMachine:
    ladder = ModelLadder(tier=tuple(ModelTier(name=n, path=Path(f"{n}.gguf"), n_ctx=n_ctx) for n in names))
    return StateMachine(load_policy("default"), ladder=ladder, footprints={n: footprint(n) for n in names})


def size_mb(gov: StateMachine, config: EngineConfig) -> float:
    fp = gov.footprints[config.model]
    return fp.total_bytes(config.n_ctx, config.kv_type, gov.policy.memory, config.n_batch) / MIB


def ramp(start_mb: float, end_mb: float, at_s: float, over_s: float) -> Callable[[float], float]:
    """The room other programs leave the engine: `start_mb`, then down to `end_mb` along a ramp."""
    return lambda t: start_mb + (end_mb - start_mb) * min(1.0, max(0.0, (t - at_s) / over_s))


def closed_loop(
    gov: StateMachine, room: Callable[[float], float], seconds: int, *, lmkd: bool = False
) -> list[Decision]:
    out: list[Decision] = []
    config: EngineConfig | None = None
    for t in range(seconds):
        rss = size_mb(gov, config) if config is not None else 0.0
        engine = EngineObservation(busy=True, tokens_per_s=10.0, model=config.model if config else None,
                                   rss_bytes=int(rss * MIB), context_tokens=300)  # fmt: skip
        decision = gov.decide(memory(room(float(t)) - rss, 0.0, lmkd=lmkd), engine, float(t))
        config = decision.engine
        out.append(decision)
    return out


def moves(decisions: list[Decision]) -> list[Decision]:
    return [b for a, b in itertools.pairwise(decisions) if b.engine.needs_reload(a.engine)]


def switches(decisions: list[Decision]) -> list[Decision]:
    return [b for a, b in itertools.pairwise(decisions) if b.engine.model != a.engine.model]


def test_a_fall_takes_one_model_switch_to_the_tier_that_lasts() -> None:
    """8B, 1.5B and 1B tiers; the room falls from 12 GB to 900 MiB over a minute (~185 MiB/s). Before: 8B -> 1.5B when
    the 8B no longer fitted, then 1.5B -> 1B 24 s later (fleet:2:0). Now the switch is to the tier that still fits if
    the fall goes on for as long as a switch must last (the 5-minute model dwell): one switch, to the 1B."""
    gov = governor("llama-3.1-8b-q4km", "qwen2.5-1.5b-q4km", "llama-3.2-1b-q4km")
    decisions = closed_loop(gov, ramp(12000.0, 900.0, 10.0, 60.0), 200)
    assert decisions[0].engine.model == "llama-3.1-8b-q4km"
    assert [d.engine.model for d in switches(decisions)] == ["llama-3.2-1b-q4km"]
    assert all(d.engine_wait is None for d in decisions)


def test_a_shrink_goes_to_where_memory_is_going_in_one_step() -> None:
    """One tier; the room falls by 1.7 GB over a minute, to where only the tier's smallest setting fits. Before: the
    exit band found no setting with a fifth of the budget to spare, so each tick took the largest setting that fitted
    now, one reload per tick behind the fall (fleet:2:9: 6 reloads in 11 s, answers queued behind them). Now, where
    no setting has that to spare, the tier's smallest: one reload."""
    gov = governor("qwen2.5-1.5b-q4km")
    decisions = closed_loop(gov, ramp(3200.0, 1500.0, 10.0, 60.0), 200)
    assert len(moves(decisions)) <= 2, [(d.t, d.engine.describe(decisions[0].engine)) for d in moves(decisions)]
    assert decisions[-1].engine.n_ctx == 512


def test_within_the_model_dwell_the_model_in_force_runs_on_the_reserve_rather_than_switch_again() -> None:
    """1B, 0.5B and 360M tiers: memory steps down 5 s after the start (no fall to extrapolate), then falls on at 40 s to
    900 MiB. Before: 1B -> 0.5B -> 360M within 4 s (the model in force no longer fitted the budget, which let each
    switch past the model dwell; fleet:2:21), then one reload a tick while the budget walked down. Now, within the
    dwell, the model in force runs its smallest setting on the reserve while the whole of it (weights too) fits before
    a kill; then one switch, to the tier that lasts."""
    gov = governor("llama-3.2-1b-q4km", "qwen2.5-0.5b-q4km", "smollm2-360m-q8")

    def room(t: float) -> float:
        return ramp(1300.0, 1130.0, 5.0, 2.0)(t) if t < 40 else ramp(1130.0, 900.0, 40.0, 60.0)(t)

    decisions = closed_loop(gov, room, 400)
    moved = switches(decisions)
    assert len(moved) == 1, [(d.t, d.engine.model) for d in moved]
    assert len(moves(decisions)) <= 3
    assert decisions[10].readings["fit_bound"] == "below its footprint"
    assert all(d.engine_wait is None for d in decisions)


def test_a_slow_drift_is_not_extrapolated_over_the_model_dwell() -> None:
    """Memory steps down (the 1B no longer fits with the exit band's spare) and then drifts 5 MiB/s, as MemAvailable
    does with the page cache's churn: within noise over the 6 s window (less than `grow_margin_mb`), so the switch is
    to the tier that fits with the spare (the 0.5B), not to the one a 5-minute extrapolation of the drift would leave
    (the 360M)."""
    gov = governor("llama-3.2-1b-q4km", "qwen2.5-0.5b-q4km", "smollm2-360m-q8")

    def room(t: float) -> float:
        return 2000.0 if t < 300 else 1700.0 - 5.0 * (t - 300)  # after the first load's model dwell

    decisions = closed_loop(gov, room, 420)
    assert [d.engine.model for d in switches(decisions)] == ["qwen2.5-0.5b-q4km"]


def second_switch(*, lmkd: bool) -> Decision:
    """Memory falls from 1300 to 1130 MiB at 300 s (one switch, to the 0.5B) and to 720 MiB at 330 s, inside the model
    dwell: the second switch, to the smallest tier, excused (`switch_kill`) where the first records nothing."""
    gov = governor("llama-3.2-1b-q4km", "qwen2.5-0.5b-q4km", "smollm2-360m-q8", n_ctx=4096)

    def room(t: float) -> float:
        return 1300.0 if t < 300 else 1130.0 if t < 330 else 720.0

    moved = switches(closed_loop(gov, room, 360, lmkd=lmkd))
    assert [d.engine.model for d in moved] == ["qwen2.5-0.5b-q4km", "smollm2-360m-q8"]
    first, second = moved
    assert first.readings["switch_kill"] is None
    assert second.readings["switch_kill"] is True
    return second


def test_a_second_switch_within_the_dwell_only_for_a_predicted_kill_and_the_decision_says_so() -> None:
    """Where Android's lmkd counts the mapped weights: a step takes the 1B to the 0.5B; 30 s later another leaves
    620 MiB before a kill, less than the 0.5B's smallest setting (680 MiB). The second switch (to the 360M) cannot
    wait its 5 minutes; the decision records why (`switch_kill`, and the reason), which is what lets the lab's judge
    excuse it. The first switch records nothing."""
    second = second_switch(lmkd=True)
    assert "switch within the model dwell: qwen2.5-0.5b-q4km would be killed" in second.reason


def test_a_second_switch_within_the_dwell_when_keeping_the_model_would_cross_the_memory_floor() -> None:
    """As above, but where the kernel's killer spares the mapped weights: 720 MiB left, the 0.5B's smallest setting
    (680 MiB, weights too) would leave less than the 100 MiB memory floor, which is critical (the smallest tier) at
    the next tick anyway. The switch is excused, and says so (issue 27's fleet: 2 memory-squeeze cells of 1000
    counted it as a switch within 5 minutes; kept in the lab, the model met the floor 0.5 s later)."""
    second = second_switch(lmkd=False)
    assert "would leave less than the 100 MiB memory floor" in second.reason
