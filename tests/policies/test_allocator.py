"""The power budget's allocation to clock x threads x rate, the device model learned online, and the policy."""

from __future__ import annotations

import random

from policies import StateMachine
from policies.allocator import Choice, PowerAllocator, allocate
from policies.decision import State
from policies.devicemodel import DeviceModel
from policies.loader import load_policy
from policies.memfit import ModelFootprint
from policies.schema import Power
from sensors.snapshot import Cpu, EngineObservation
from tests.policies.builders import run, snap
from tests.policies.conftest import make_policy

RATIOS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def alloc(model: DeviceModel, u: float, ratios: tuple[float, ...] = RATIOS) -> Choice:
    return allocate(model, u, threads=range(1, 5), ratios=ratios, full_threads=4, max_rate=20.0, min_rate=1.0)


def compute_bound() -> DeviceModel:
    return DeviceModel(Power(idle_w=2.0, core_w=1.0, freq_exponent=2.5, thread_tok_s=1.0))


def test_a_compute_bound_budget_goes_to_every_thread_at_a_lower_clock() -> None:
    choice = alloc(compute_bound(), 0.5)
    assert choice.threads == 4
    assert choice.freq_ratio == 0.7  # 4 x 0.7^2.5 = 1.64 <= half of 4 load units; 0.8 would be 2.29
    assert choice.rate is None
    assert choice.power_w <= choice.budget_w
    alt = choice.alternative
    assert alt is not None
    assert alt.threads == 3
    assert choice.tok_s is not None
    assert alt.tok_s is not None
    assert choice.tok_s > alt.tok_s


def test_the_same_watts_give_more_tokens_than_taking_threads() -> None:
    """The issue's finding, as a property: at any budget the allocator beats the best threads-only choice."""
    model = compute_bound()
    for u in (0.2, 0.35, 0.5, 0.75, 0.9):
        with_clock = alloc(model, u)
        threads_only = alloc(model, u, (1.0,))
        assert with_clock.tok_s is not None
        assert threads_only.tok_s is not None
        assert with_clock.tok_s >= threads_only.tok_s
        if u <= 0.5:  # the deeper the cut, the more the clock's f^2.5 pays
            assert with_clock.tok_s > 1.2 * threads_only.tok_s
        assert with_clock.power_w <= with_clock.budget_w + 1e-9


def test_below_the_lowest_clock_the_rate_cap_takes_the_rest() -> None:
    assert alloc(compute_bound(), 0.05).rate is None  # one thread at half clock still fits: no cap
    choice = alloc(compute_bound(), 0.01)  # nothing fits: the lowest clock, and the rate cap
    assert choice.freq_ratio == 0.4
    assert choice.rate is not None
    assert choice.rate >= 1.0


def test_a_memory_ceiling_learned_online_lowers_the_clock_for_free() -> None:
    """tok/s = min(1.0 x threads x f, 2.4): four threads need only f = 0.6 for the ceiling; the model learns it."""
    model = DeviceModel(Power())
    for threads, freq in [(4, 1.0), (2, 0.5), (4, 0.8), (1, 1.0), (4, 0.5)] * 4:
        model.observe(threads, freq, min(1.0 * threads * freq, 2.4), None, None)
    assert model.a is not None
    assert abs(model.a - 1.0) < 0.05
    assert model.ceiling is not None
    assert abs(model.ceiling - 2.4) < 0.05
    choice = alloc(model, 1.0)  # the full budget: the most tokens, then the fewest watts
    assert choice.freq_ratio == 0.6
    assert choice.threads == 4


def test_rate_limited_tokens_do_not_teach_the_speed() -> None:
    model = DeviceModel(Power())
    model.observe(4, 1.0, 4.0, None, None)
    model.observe(4, 1.0, 1.95, 2.0, None)  # the rate cap, not the device, held it at 2 tok/s
    assert model.ceiling is None
    assert model.a == 1.0


def test_watts_are_learned_from_a_discharging_battery() -> None:
    """P = 1.5 W + 0.8 W per thread·f^2.5, read with noise; the prior (2 W, 1.5 W) is forgotten."""
    model = DeviceModel(Power(idle_w=2.0, core_w=1.5))
    rng = random.Random(3)
    for _ in range(300):
        threads, freq = rng.choice((1, 2, 3, 4)), rng.choice(RATIOS)
        watts = 1.5 + 0.8 * threads * freq**2.5 + rng.gauss(0, 0.05)
        model.observe(threads, freq, 3.0, None, watts)
    assert abs(model.idle_w - 1.5) < 0.1
    assert abs(model.core_w - 0.8) < 0.05


def hot_policy() -> StateMachine:
    policy = make_policy(states={"hot": {"threads": 4, "min_threads": 1}})
    return StateMachine(policy, freq_ratios=RATIOS)


def test_hot_caps_the_clock_and_keeps_the_threads_when_the_clock_is_writable() -> None:
    gov = hot_policy()
    decisions = run(gov, [snap(80.5)] * 12)  # 1 °C over the setpoint: the budget shrinks, some of it stays
    last = decisions[-1]
    assert last.state == State.HOT
    assert last.freq_ratio is not None
    assert last.freq_ratio < 1.0
    assert last.engine.threads == 4
    assert "power budget" in last.reason
    assert "% clock x 4 threads" in last.reason
    assert last.readings["budget_w"] is not None


def test_without_a_writable_clock_hot_takes_threads_as_before() -> None:
    policy = make_policy(states={"hot": {"threads": 4, "min_threads": 1}})
    decisions = run(StateMachine(policy), [snap(85.0)] * 12)
    assert decisions[-1].state == State.HOT
    assert decisions[-1].freq_ratio is None
    assert decisions[-1].engine.threads < 4
    assert "power budget" not in decisions[-1].reason


def test_the_policy_can_refuse_the_clock_cap() -> None:
    policy = make_policy(states={"hot": {"threads": 4, "min_threads": 1}}, power={"freq_cap": False})
    decisions = run(StateMachine(policy, freq_ratios=RATIOS), [snap(85.0)] * 12)
    assert all(d.freq_ratio is None for d in decisions)


def test_critical_takes_the_lowest_clock() -> None:
    gov = hot_policy()
    decisions = run(gov, [snap(95.0)] * 4)
    assert decisions[-1].state == State.CRITICAL
    assert decisions[-1].freq_ratio == RATIOS[0]


def test_cooling_down_lifts_the_cap_only_after_the_threads_are_back() -> None:
    gov = hot_policy()
    run(gov, [snap(85.0)] * 12)
    cool = run(gov, [snap(50.0)] * 40, t0=12)
    assert cool[-1].state != State.HOT
    assert cool[-1].freq_ratio is None
    assert cool[-1].engine.threads == 4


def test_the_model_learns_from_the_engines_counters_in_hot() -> None:
    gov = hot_policy()
    engine = EngineObservation(busy=True, tokens_per_s=6.0)
    run(gov, [snap(85.0)] * 12, engine=engine)
    assert gov.power.model.observations > 0
    assert gov.power.model.a is not None


def test_with_the_clock_the_setpoint_sits_closer_to_the_trip() -> None:
    """The test policy's trip is 80 °C and control margin 2 °C; with a writable clock [power] allows 0.5 °C."""
    with_clock = run(hot_policy(), [snap(79.0)] * 6)[-1]
    threads_only = run(StateMachine(make_policy()), [snap(79.0)] * 6)[-1]
    assert with_clock.readings["setpoint_c"] == 79.5
    assert threads_only.readings["setpoint_c"] == 78.0


def test_once_the_kernel_throttles_the_setpoint_leaves_its_hysteresis_band() -> None:
    """A touch of the trip gives the kernel a step that its trip's hysteresis holds until the zone falls under it:
    at a setpoint 0.5 °C under the trip it never would (the pi4 board beside a hog: 21 % of the run throttled)."""
    throttled = snap(79.0).model_copy(update={"cpu": Cpu(freq_ratio=0.9, throttled=True)})
    decisions = run(hot_policy(), [snap(79.0)] * 6 + [throttled] * 3 + [snap(79.0)] * 3)
    assert [d.readings["setpoint_c"] for d in decisions[5:]] == [79.5] + [76.5] * 3 + [79.5] * 3


def memory_bound(freq: float) -> float:
    """4 threads: compute 1.4 tok/s per thread·clock, memory ceiling 4.2 tok/s (a Pi 5 with a 3B model)."""
    return min(1.4 * 4 * freq, 4.2)


def test_a_flat_rate_between_two_clocks_reveals_the_memory_ceiling() -> None:
    """Only ever run at 90-100 % clock: per-thread speed looks like the peak (it is all `a` ever sees), but the
    10 % more clock bought no tokens, so decode is memory-bound there."""
    model = DeviceModel(Power())
    for freq in (1.0, 0.9) * 5:
        model.observe(4, freq, memory_bound(freq), None, None)
    assert model.ceiling is not None
    assert abs(model.ceiling - 4.2) < 0.05
    assert alloc(model, 0.95).freq_ratio == 0.9  # the same tokens as at 1.0 for 0.9^2.5 of the watts


def test_decoding_at_the_ceiling_tries_lower_clocks_down_to_the_crossover() -> None:
    power = PowerAllocator(make_policy(states={"hot": {"threads": 4, "min_threads": 1}}), RATIOS, None)
    seen = []
    for _ in range(60):
        freq = power.allocate(0.95, 4).freq_ratio
        power.model.observe(4, freq, memory_bound(freq), None, None)
        seen.append(freq)
    assert 0.7 in seen  # tried once: slower (3.9 tok/s) ...
    assert seen[-20:] == [0.8] * 20  # ... so it stays at the crossover: 4.48 tok/s of compute for the 4.2 ceiling
    assert power.allocate(0.95, 4, prefill=True).freq_ratio == 0.9  # a prompt is compute-bound: the budget's clock


def test_beside_others_work_the_clock_steps_under_a_budget_that_does_not_bind() -> None:
    """Contended, the model learns nothing and the ceiling stays unknown: at the top clock the watts go mostly to the
    others' work while decode is paced by the engine's share of the cores. A step under, as the kernel's at the trip."""
    power = PowerAllocator(make_policy(states={"hot": {"threads": 4, "min_threads": 1}}), RATIOS, None)
    power.model.observe(4, 1.0, memory_bound(1.0), None, None)  # the top clock only: no ceiling known
    assert power.model.ceiling is None
    assert power.allocate(1.0, 4).freq_ratio == 1.0  # alone, the budget does not bind: nothing to save
    assert power.allocate(1.0, 4, contended=True).freq_ratio == 0.9
    assert power.allocate(1.0, 4, contended=True, prefill=True).freq_ratio == 1.0  # a prompt: compute-bound


def test_out_of_hot_the_cap_comes_back_from_the_budgets_clock_not_the_ceilings() -> None:
    """At the memory ceiling the allocator decodes at the crossover clock for energy; that is no thermal limit, so
    leaving hot the ramp starts from the clock the budget allowed (here the top one: the cap lifts at once) and the
    next prompt, compute-bound, does not start at the crossover clock."""
    power = PowerAllocator(make_policy(states={"hot": {"threads": 4, "min_threads": 1}}), RATIOS, None)
    for freq in (1.0, 0.9) * 5:
        power.model.observe(4, freq, memory_bound(freq), None, None)
    assert power.allocate(1.0, 4).freq_ratio == 0.9  # the same 4.2 tok/s for less power (a = 4.2 / 3.6 learned)
    assert power.freq_now(100.0, 10.0) == 0.9
    power.choice = None  # out of hot
    assert power.freq_now(101.0, 10.0) is None  # the budget allowed the top clock
    assert power.allocate(0.5, 4).freq_ratio == 0.7  # a binding budget: 4 x 0.8^2.5 = 2.29 > 2 load units
    assert power.freq_now(200.0, 10.0) == 0.7
    power.choice = None
    assert power.freq_now(201.0, 10.0) == 0.7  # the budget's clock is the ramp's start ...
    assert power.freq_now(210.0, 10.0) == 0.8  # ... then a step per recover step


def guarded(margin_c: float) -> StateMachine:
    policy = load_policy("default")
    power = policy.power.model_copy(update={"guard_margin_c": margin_c})
    return StateMachine(policy.model_copy(update={"power": power}), freq_ratios=RATIOS)


def test_near_the_trip_and_rising_the_clock_drops_a_step_per_tick_before_the_pi_would() -> None:
    """The shipped gains are gentle (k_po ~0.1 per °C): a load step at the setpoint, 0.5 °C under the trip, heats the
    die past the trip before the PI cuts a clock step (the pi4 board at a build's end: 79.5 -> 80.0 °C in 7 s, then
    the kernel's step). The guard takes a step per rising tick within 0.25 °C of the trip; once it acts, the PI goes
    on from the budget in force (back-calculation), so the clock does not bounce back as the die cools."""
    temps = [76.0] * 3 + [79.0] * 12 + [79.6, 79.7, 79.8, 79.9, 79.95, 79.9, 79.8, 79.7, 79.6]
    prompt = EngineObservation(busy=True)  # compute-bound: no ceiling exploration in the way
    clocks = {}
    for margin in (0.25, 0.0):
        gov = guarded(margin)
        decisions = run(gov, [snap(x, trips=[("passive", 80.0)]) for x in temps], dt=0.5, engine=prompt)
        assert all(d.state == State.HOT for d in decisions[14:])
        clocks[margin] = [d.freq_ratio for d in decisions[15:]]
    assert clocks[0.0] == [0.9] * 9  # the PI alone: 0.93-0.96 all the way to 79.95 °C, the 0.9 step's budget
    # from 79.8 °C (>= 79.75), while rising, a step a tick; at 79.9 °C rising 0.1 °C a tick the trip is a tick away:
    # the lowest clock at once
    assert clocks[0.25] == [0.9, 0.9, 0.8, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]


def test_the_guard_acts_only_within_its_margin_of_the_trip_and_while_rising() -> None:
    power = PowerAllocator(make_policy(states={"hot": {"threads": 4, "min_threads": 1}}), RATIOS, None)
    assert power.guard(1.0, 79.5, 80.0, 4, 4) == 1.0  # no earlier reading: nothing to compare
    assert power.guard(1.0, 79.7, 80.0, 4, 4) == 1.0  # rising, but 0.3 °C under the trip
    assert power.guard(1.0, 79.8, 80.0, 4, 4) == 0.9**2.5  # rising within 0.25 °C: the clock step under 1.0
    assert power.guard(1.0, 79.8, 80.0, 4, 4) == 1.0  # level: the PI's own
    assert power.guard(0.5, 79.85, 80.0, 4, 4) == 0.5  # the PI already asks for less: kept
    assert power.guard(1.0, 80.5, 80.0, 2, 4) == 2 * 0.9**2.5 / 4  # at the threads in force (over the trip: a step)


def test_speed_figures_are_the_models_and_come_back_with_it() -> None:
    """The N100 under a memory squeeze: the 3B tier taught 2.1 tok/s per thread·clock; back on the 8B model (0.85)
    every figure looked ceiling-limited against that, and choosing for the ceiling lowered the clock, which lowered the
    ceiling (3.4 -> 1.1 tok/s, 3 threads at 29 % clock at 62 °C). The watts stay the device's."""
    power = PowerAllocator(make_policy(states={"hot": {"threads": 4, "min_threads": 1}}), RATIOS, None)

    def decode(model: str, tok_s: float) -> None:
        power.observe(
            4, None, 1.0, EngineObservation(busy=True, tokens_per_s=tok_s, model=model), battery=None, on_power=True
        )

    for _ in range(20):
        decode("3b", 8.4)
    assert power.model.a is not None
    assert abs(power.model.a - 2.1) < 0.01
    for _ in range(20):
        decode("8b", 3.4)
    assert power.model.ceiling is None  # 0.85 per thread·clock is the 8B model's own compute line
    assert power.model.a is not None
    assert abs(power.model.a - 0.85) < 0.01
    full = power.allocate(1.0, 4)
    assert (full.threads, full.freq_ratio) == (4, 1.0)  # not the lowest-watt setting at a made-up ceiling
    decode("3b", 8.4)
    assert abs(power.model.a - 2.1) < 0.01  # what the 3B model measured comes back with it


def test_the_allocators_grid_follows_the_thread_range_and_the_clock_table() -> None:
    """The (threads, clock, load) grid is kept per model between ticks: other threads or another table rebuild it."""
    model = compute_bound()
    wide = allocate(model, 1.0, threads=range(1, 5), ratios=RATIOS, full_threads=4, max_rate=None, min_rate=None)
    assert (wide.threads, wide.freq_ratio) == (4, 1.0)
    narrow = allocate(model, 1.0, threads=range(1, 3), ratios=RATIOS, full_threads=4, max_rate=None, min_rate=None)
    assert (narrow.threads, narrow.freq_ratio) == (2, 1.0)
    slow = allocate(model, 1.0, threads=range(1, 3), ratios=(0.4, 0.5), full_threads=4, max_rate=None, min_rate=None)
    assert (slow.threads, slow.freq_ratio) == (2, 0.5)
    assert (
        allocate(model, 1.0, threads=range(1, 5), ratios=RATIOS, full_threads=4, max_rate=None, min_rate=None) == wide
    )


def test_a_prompt_gets_the_whole_budget_only_with_room_under_the_setpoint() -> None:
    """Back under the setpoint after a hot spell, the PI's output falls below 1 as the die approaches it again (its
    integral was spent above it), and it cut a prompt's clock: compute-bound, every step costs time to first token,
    where `none` runs the prompt at the top clock and is throttled later, in the decode at the memory ceiling (free).
    So a prompt under the setpoint got the whole budget; but within 1 °C of it the whole budget takes a small die over
    the trip within a tick, the kernel's step drops the setpoint and the budget to its floor, and the threads come
    back one per recover step for minutes (fleet:2:57's long chat, 0.88 x `none`'s tokens). There, and over the
    setpoint, the PI's budget holds; a decode keeps its own allocation."""
    temps = [76.0] * 3 + [80.3] * 40 + [77.0] * 4 + [78.6, 78.9, 79.2, 79.4]
    prompt, decoding = EngineObservation(busy=True), EngineObservation(busy=True, tokens_per_s=3.0)
    gov = guarded(0.25)
    decisions = run(gov, [snap(x, trips=[("passive", 80.0)]) for x in temps], dt=0.5, engine=prompt)
    assert all(d.state == State.HOT for d in decisions[4:])
    assert decisions[42].freq_ratio == 0.8  # over the setpoint (79.5 °C): the PI's budget, prompt or not
    assert [d.freq_ratio for d in decisions[-8:-4]] == [None] * 4  # 2.5 °C under it: the top clock
    near = decisions[-3:]  # 78.9 -> 79.4 °C: within 1 °C
    assert all(isinstance(u, float) and u < 0.96 for u in (d.readings["pi_output"] for d in near))
    assert all(d.freq_ratio is not None and d.freq_ratio < 1.0 for d in near)  # the PI's budget
    gov = guarded(0.25)
    decisions = run(gov, [snap(x, trips=[("passive", 80.0)]) for x in temps[:-4]], dt=0.5, engine=prompt)
    decisions = run(gov, [snap(x, trips=[("passive", 80.0)]) for x in temps[-4:]], dt=0.5, t0=23.5, engine=decoding)
    assert all(d.freq_ratio is not None and d.freq_ratio < 1.0 for d in decisions)


def test_the_memory_ceiling_follows_the_context_fill() -> None:
    """Decode at the memory ceiling reads the weights and the KV of every context token: on a Pi 5's 3B model (1.9 GB
    of weights, 112 KiB of f16 KV a token) 4.19 tok/s at 2,000 tokens of context is 4.64 at a new conversation's 100.
    One ceiling learned over the full context chose 80 % clock for the new conversation, 4.48 tok/s (compute) where
    the memory allowed 4.64; the ceiling kept for an empty context and scaled by the fill asks for 90 %."""
    fp = ModelFootprint(
        file_bytes=1926 * 2**20, n_layer=28, n_embd=3072, n_head=24, n_head_kv=8, head_dim_k=128, head_dim_v=128,
        n_vocab=128256,
    )  # fmt: skip
    kv = fp.kv_bytes(1, "f16")
    power = PowerAllocator(make_policy(states={"hot": {"threads": 4, "min_threads": 1}}), RATIOS, None, {"3b": fp})

    def decode(freq: float, fill: int) -> None:
        ceiling = 4.67 / (1 + kv * fill / fp.file_bytes)
        engine = EngineObservation(
            busy=True, tokens_per_s=min(1.4 * 4 * freq, ceiling), model="3b", context_tokens=fill
        )
        power.context(engine, "f16")
        power.freq = freq
        power.observe(4, None, freq, engine, battery=None, on_power=True)

    for _ in range(10):
        for freq in (1.0, 0.9, 0.8):
            decode(freq, 2000)
    assert power.model.ceiling is not None
    assert abs(power.model.ceiling - 4.19) < 0.02
    new = EngineObservation(busy=True, tokens_per_s=4.6, model="3b", context_tokens=100)
    power.context(new, "f16")
    assert abs(power.model.ceiling - 4.64) < 0.02
    choice = power.allocate(1.0, 4)
    assert (choice.threads, choice.freq_ratio) == (4, 0.9)
    power.context(EngineObservation(busy=True, model="3b"), "f16")  # an engine that does not say: the empty context's
    assert abs(power.model.ceiling - 4.19 * (1 + kv * 2000 / fp.file_bytes)) < 0.1
