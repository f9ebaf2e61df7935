"""Hot steps down the model ladder where the power that keeps the trip leaves the tier in force far slower than the
ungoverned engine (policies/tierstep.py, rule `thermal.tier`), and with no smaller tier to win it back yields to the
kernel (rule `thermal.kernel`, policies/hot.py `losing`); the trip guard at the lowest clock takes a thread; a zone
under its trip, the kernel's step only waiting out its hysteresis, is no reason to step aside."""

from __future__ import annotations

import itertools
from pathlib import Path

from governor.lab.fleet import CATALOGUE
from policies import StateMachine
from policies.allocator import PowerAllocator
from policies.authority import WINDOW_S, Authority
from policies.decision import Decision, State
from policies.hot import LOSING_S
from policies.ladder import ModelLadder, ModelTier
from policies.loader import load_policy
from policies.memfit import ModelFootprint
from policies.tierstep import BACK, HOLD_S, LOSS, TierStep
from sensors.snapshot import Cpu, EngineObservation, Snapshot
from tests.policies.builders import snap
from tests.policies.conftest import make_policy

MIB = 1 << 20
RATIOS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
BIG, SMALL = "llama-3.2-3b-q4km", "qwen2.5-0.5b-q4km"  # 1926 and 491 MB: about 4x the tokens per watt


def footprint(name: str) -> ModelFootprint:
    m = next(c for c in CATALOGUE if c.name == name)
    return ModelFootprint(int(m.weights_mb * MIB), m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.head_dim,
                          m.head_dim, m.n_vocab)  # fmt: skip


def governor(freq_ratios: tuple[float, ...] | None = RATIOS) -> StateMachine:
    ladder = ModelLadder(tier=tuple(ModelTier(name=n, path=Path(f"{n}.gguf"), n_ctx=4096) for n in (BIG, SMALL)))
    footprints = {n: footprint(n) for n in (BIG, SMALL)}
    return StateMachine(load_policy("default"), ladder=ladder, footprints=footprints, freq_ratios=freq_ratios)


def at_the_trip(temp_c: float, clock: float, throttled: bool = False) -> Snapshot:
    """An 8-core board whose idle power alone holds the die near its 80 °C trip."""
    cpu = Cpu(freq_ratio=clock, throttled=throttled, count=8)
    return snap(temp_c, trips=[("passive", 80.0), ("critical", 105.0)]).model_copy(update={"cpu": cpu})


def play(
    gov: StateMachine, seconds: float, dt: float = 0.25, temp_c: float = 79.7, throttled: bool = False
) -> list[Decision]:
    """The die held at `temp_c` whatever the engine does; the engine decodes at what its setting gives (per thread x
    clock: 0.29 tok/s for the 3B model, 1.3 for the 0.5B, as fleet:2:193's)."""
    out: list[Decision] = []
    last = gov.last
    t = last.t + dt if last is not None else 0.0
    end = t + seconds
    model, threads = (last.engine.model, last.engine.threads) if last is not None else (BIG, 8)
    clock = (last.freq_ratio or 1.0) if last is not None else 1.0
    while t < end:
        tok_s = (0.29 if model == BIG else 1.3) * threads * clock
        snapshot = at_the_trip(temp_c, clock, throttled)
        d = gov.decide(snapshot, EngineObservation(busy=True, tokens_per_s=tok_s, model=model), t)
        model, threads, clock = d.engine.model, d.engine.threads, d.freq_ratio or 1.0
        out.append(d)
        t += dt
    return out


def test_a_budget_that_leaves_the_tier_a_fraction_of_the_ungoverned_engine_steps_a_tier_down() -> None:
    """fleet:2:193 (8 cores, writable clock, 3.8 W idle behind 14 K/W, trip 80 °C): hot's budget is two threads at the
    lowest clock, 0.3 tok/s of the 3B model; the ungoverned engine runs every thread at the kernel's lowest clock 17 °C
    over the trip, 1.2 tok/s. The 0.5B tier decodes about 4x faster per watt: hot allows it, and the switch pays its
    price at once."""
    out = play(governor(), 360.0)
    assert out[-1].state == State.HOT
    assert out[-1].engine.model == SMALL
    step = next(d for d in out if d.engine.model == SMALL)
    assert step.rule == "thermal.tier"
    assert "the ungoverned engine" in step.reason
    assert "qwen2.5-0.5b-q4km at most" in step.reason
    assert sum(1 for a, b in itertools.pairwise(out) if a.engine.model != b.engine.model) == 1


def test_without_a_writable_clock_the_tier_stays() -> None:
    out = play(governor(None), 360.0)
    assert all(d.engine.model == BIG for d in out)


def test_the_step_waits_its_hold_and_a_bigger_tier_comes_back_when_it_would_not_lose() -> None:
    steps = TierStep([BIG, SMALL], {BIG: 4.0, SMALL: 1.0})
    t = 0.0
    while t < HOLD_S:
        assert steps.observe(t, BIG, 0.5 * LOSS) is None  # losing, for less than the hold
        t += 1.0
    assert steps.observe(t, BIG, 0.5 * LOSS) == SMALL
    # on the small tier: the share in the big tier's units is 4x, no further step (there is none) and no way back
    # until the big tier itself would decode BACK x the ungoverned engine
    assert steps.observe(t + 1, SMALL, 0.5 * LOSS) == SMALL
    assert steps.share is not None
    assert steps.share > LOSS
    t += 2
    start = t
    while t - start < HOLD_S:
        assert steps.observe(t, SMALL, BACK) == SMALL
        t += 1.0
    assert steps.observe(t, SMALL, BACK) is None
    steps.observe(t + 1, BIG, 0.1)
    steps.leave()
    assert steps.limit is None


def test_with_no_smaller_tier_a_budget_that_loses_to_the_kernel_yields_to_it() -> None:
    """fleet:2:174 (8 cores, writable clock, idle 73 °C under an 85 °C trip, one model): hot's budget at the trip was
    4-5 threads at the lowest clock, 0.62-0.73 x the tokens of `none`, which the kernel ran on every thread at its
    lowest clock at 95 °C (critical 101 °C). Never lose to nothing: hot yields, every thread, the clock released, while
    the kernel throttles over the trip; the why names the rule and both predictions. Back once the kernel is calm."""
    gov = StateMachine(load_policy("default"), freq_ratios=RATIOS)
    cut = play(gov, 240.0)
    yielded = next(i for i, d in enumerate(cut) if d.rule == "thermal.kernel")
    over = play(gov, 300.0, temp_c=82.0, throttled=True)  # the kernel throttles every thread over the trip
    aside = cut[yielded:] + over
    assert all(d.rule == "thermal.kernel" and d.state == State.HOT for d in aside)
    assert (over[-1].engine.threads, over[-1].engine.max_tokens_per_s, over[-1].freq_ratio) == (8, None, None)
    assert "predicted ungoverned (every thread at the lowest clock, over the trip" in over[-1].reason
    assert sum(1 for a, b in itertools.pairwise(aside) if a.engine != b.engine) <= 4  # the threads come back
    calm = play(gov, 200.0, temp_c=79.0)
    assert calm[-1].rule != "thermal.kernel"


def test_a_later_spell_in_hot_yields_without_the_wait() -> None:
    """The first spell waits out 15 s of losing on average; the loss is the device's (its idle power near the trip),
    so the next spell with the same model yields as soon as its budget loses."""
    gov = StateMachine(load_policy("default"), freq_ratios=RATIOS)
    first = play(gov, 240.0)
    cool = play(gov, 120.0, temp_c=60.0)  # a pause in the chat: out of hot
    assert cool[-1].state != State.HOT
    second = play(gov, 240.0)
    wait = [next(d.t for d in spell if d.rule == "thermal.kernel") - next(d.t for d in spell if d.state == State.HOT)
            for spell in (first, second)]  # fmt: skip
    assert wait[1] <= wait[0] - LOSING_S


def test_a_smaller_tier_that_wins_it_back_under_the_trip_comes_first() -> None:
    out = play(governor(), 360.0)
    small = next(i for i, d in enumerate(out) if d.engine.model == SMALL)
    assert all(d.rule != "thermal.kernel" for d in out[:small])


def test_yielded_with_a_clock_a_zone_nearing_critical_gets_a_rate_cap() -> None:
    gov = StateMachine(load_policy("default"), freq_ratios=RATIOS)
    play(gov, 240.0)
    near = play(gov, 120.0, temp_c=99.5, throttled=True)  # the kernel's lowest clock: toward critical (from 100)
    assert near[-1].rule == "thermal.kernel"
    assert near[-1].engine.max_tokens_per_s is not None
    assert "a rate cap on every thread" in near[-1].reason


def test_a_smaller_tier_not_much_faster_is_not_worth_a_model_load() -> None:
    steps = TierStep([BIG, SMALL], {BIG: 1.1, SMALL: 1.0})
    for t in range(int(3 * HOLD_S)):
        assert steps.observe(float(t), BIG, 0.1) is None


def test_at_the_lowest_clock_the_trip_guard_takes_a_thread() -> None:
    policy = make_policy(states={"hot": {"threads": 4, "min_threads": 1}})
    power = PowerAllocator(policy, RATIOS, None)
    power.freq = RATIOS[0]
    assert power.guard(1.0, 79.5, 80.0, 3, 4) == 1.0
    assert power.guard(1.0, 79.8, 80.0, 3, 4) == 2 * 0.5**2.5 / 4  # rising within 0.25 °C: one thread fewer
    assert power.guard(1.0, 79.9, 80.0, 1, 4) == 1.0  # one thread at the lowest clock: nothing left to take


def test_a_rise_that_reaches_the_trip_by_the_next_tick_takes_the_lowest_clock_at_once() -> None:
    """fleet:2:108: a 2.1 J/K die under a prompt rises 0.2-0.3 °C a tick; a clock step a tick let it past the trip,
    and the kernel's step then held for minutes (its 3.1 °C of hysteresis)."""
    policy = make_policy(states={"hot": {"threads": 4, "min_threads": 1}})
    power = PowerAllocator(policy, RATIOS, None)
    assert power.guard(1.0, 79.7, 80.0, 2, 4) == 1.0  # no earlier reading
    assert power.guard(1.0, 79.8, 80.0, 2, 4) == 2 * 0.9**2.5 / 4  # within the margin, 0.1 °C a tick: one step
    assert power.guard(1.0, 79.9, 80.0, 2, 4) == 2 * 0.5**2.5 / 4  # the trip a tick away at this rise: the lowest


def test_a_zone_under_its_trip_waiting_out_the_kernels_hysteresis_is_no_reason_to_step_aside() -> None:
    """fleet:2:108: a prompt touched the 70 °C trip; the kernel's step holds until 66.9 °C (3.1 °C of hysteresis) and
    hot's floor keeps the die at 68.8 °C: the heat is the engine's floor, not others'. Stepping aside ran every thread
    into the trip (63 points over the world alone)."""
    held, at_trip = Authority(), Authority()
    for i in range(int(3 * WINDOW_S)):
        held.aside(float(i), hot=True, u=0.0, throttled=True, temp_c=68.8, trip_c=70.0)
        at_trip.aside(float(i), hot=True, u=0.0, throttled=True, temp_c=70.1, trip_c=70.0)
    assert held.back_after_s is None
    assert at_trip.back_after_s is not None
