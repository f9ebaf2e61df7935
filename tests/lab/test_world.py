"""The simulated engine's performance and memory model, and the world's battery and snapshots."""

from __future__ import annotations

import pytest

from governor.clock import VirtualClock
from governor.lab.catalog import load_device
from governor.lab.device import MB
from governor.lab.engine import EngineSim
from governor.lab.twins import SimulatedDevice
from governor.lab.workload import EventSpec, PhaseSpec, Request, WorkloadSpec
from governor.lab.world import World
from policies.decision import EngineConfig

PI = load_device("raspberry-pi-5")
PHONE = load_device("phone")
BIG, SMALL = PI.engine.model[0], PI.engine.model[1]


def first_decode_rate(threads: int, freq: float, cap: float | None = None, device_name: str = PI.name) -> float:
    device = load_device(device_name)
    engine = EngineSim(device.engine, device.cpu)
    top = device.engine.model[0]
    engine.apply(EngineConfig(threads=threads, n_ctx=2048, model=top.name, max_tokens_per_s=cap), 0.0)
    engine.submit(Request(0.0, prompt_tokens=10, answer_tokens=50, new_conversation=True, system_tokens=0))
    t = 0.0
    while not engine.stats.rate_samples:
        engine.step(t, 0.25, freq)
        t += 0.25
    return engine.stats.rate_samples[0][0]


def test_decode_is_bandwidth_bound_at_full_clock_and_compute_bound_when_throttled() -> None:
    weights = BIG.weights_mb * MB
    bandwidth_limit = PI.engine.bandwidth_gb_s * 1e9 / (weights + BIG.kv_bytes_per_token("f16") * 10)
    assert first_decode_rate(4, 1.0) == pytest.approx(bandwidth_limit)  # 4 x 1.4 = 5.6 > 4.45: memory-bound
    assert first_decode_rate(4, 0.5) == pytest.approx(4 * 0.5 * BIG.thread_tok_s)  # 2.8: compute-bound
    assert first_decode_rate(2, 1.0) == pytest.approx(2 * BIG.thread_tok_s)
    assert first_decode_rate(4, 1.0, cap=2.0) == pytest.approx(2.0)


def test_threads_on_little_cores_slow_the_phone_down() -> None:
    four, eight = first_decode_rate(4, 1.0, device_name="phone"), first_decode_rate(8, 1.0, device_name="phone")
    assert eight == pytest.approx(8 * 0.3 * PHONE.engine.model[0].thread_tok_s)
    assert eight < four


def test_a_longer_context_slows_decode() -> None:
    engine = EngineSim(PI.engine, PI.cpu)
    engine.apply(EngineConfig(threads=4, n_ctx=4096, model=BIG.name), 0.0)
    engine.submit(Request(0.0, prompt_tokens=3000, answer_tokens=20, new_conversation=True, system_tokens=0))
    t = 0.0
    while engine.busy():
        engine.step(t, 0.25, 1.0)
        t += 0.25
    late = engine.stats.rate_samples[-1][0]
    assert late < first_decode_rate(4, 1.0) * 0.95
    assert engine.stats.ttft_s[0] > 3000 / (4 * BIG.prefill_thread_tok_s)  # the prompt was evaluated first


def test_changing_the_kv_type_mid_answer_reloads_and_evaluates_the_context_again() -> None:
    engine = EngineSim(PI.engine, PI.cpu)
    engine.apply(EngineConfig(threads=1, n_ctx=2048, model=BIG.name), 0.0)
    engine.submit(Request(0.0, prompt_tokens=500, answer_tokens=300, new_conversation=True, system_tokens=0))
    t = 0.0
    while engine.stats.tokens < 50:
        engine.step(t, 0.25, 1.0)
        t += 0.25
    # one thread: cold, as in the real engine (the warm swap with more threads: tests/lab/test_swap.py)
    engine.apply(EngineConfig(threads=1, n_ctx=2048, kv_type="q8_0", model=BIG.name), t)
    engine.apply(EngineConfig(threads=2, n_ctx=2048, kv_type="q8_0", model=BIG.name), t)  # threads: live
    assert engine.stats.reloads == 2  # the first load and the KV change
    while engine.busy():
        engine.step(t, 0.25, 1.0)
        t += 0.25
    # the prompt, then again the prompt and the ~50 tokens answered so far, in the new context
    assert engine.stats.prefill_tokens == pytest.approx(500 + (500 + 50), abs=2)
    assert engine.stats.tokens == pytest.approx(300)


def squeezed(other_apps_mb: float) -> WorkloadSpec:
    return WorkloadSpec(
        name="squeeze",
        phase=(PhaseSpec(kind="chat", duration_s=600),),
        event=(EventSpec(at_s=60.0, other_apps_mb=other_apps_mb),),
    )


def run_full(world: World, until_s: float) -> None:
    clock = VirtualClock()
    sensors = SimulatedDevice(world, clock)
    top = world.device.engine.model[0]
    world.engine.apply(EngineConfig(threads=world.device.cpu.cores, n_ctx=top.n_ctx, model=top.name), world.t)
    clock.advance(until_s)
    sensors.sample()


def test_other_apps_growing_gets_the_engine_oom_killed_and_shows_in_memory() -> None:
    world = World(PHONE, squeezed(other_apps_mb=6500))
    run_full(world, 55.0)
    before = world.snapshot().memory.available_bytes
    assert world.engine.stats.oom_kills == 0
    run_full(world, 120.0)
    assert world.engine.stats.oom_kills >= 1
    assert world.snapshot().memory.available_bytes != before
    roomy = World(PHONE, squeezed(other_apps_mb=4600))
    run_full(roomy, 120.0)
    assert roomy.engine.stats.oom_kills == 0


def test_battery_energy_used_is_the_integral_of_power_and_the_charger_stops_the_drain() -> None:
    unplugged = World(PHONE, WorkloadSpec(name="c", phase=(PhaseSpec(kind="chat", duration_s=900),)))
    run_full(unplugged, 900.0)
    assert unplugged.battery_used_wh * 3600 == pytest.approx(unplugged.thermal.energy_in_j, rel=1e-9)
    assert unplugged.battery_used_wh > 0.2  # minutes of a few watts
    workload = WorkloadSpec(
        name="c", phase=(PhaseSpec(kind="chat", duration_s=900),), event=(EventSpec(at_s=300.0, plugged=True),)
    )
    charged = World(PHONE, workload)
    run_full(charged, 900.0)
    assert charged.battery_used_wh < unplugged.battery_used_wh / 2
    battery = charged.snapshot().battery
    assert battery is not None
    assert battery.plugged
    assert battery.charging
    assert battery.percent is not None
    assert battery.percent > 80.0 - 100 * charged.battery_used_wh / 17.0  # it charged after 300 s


def test_snapshot_looks_like_real_sensors() -> None:
    world = World(PHONE, WorkloadSpec(name="i", phase=(PhaseSpec(kind="idle", duration_s=10),)))
    snap = world.snapshot()
    assert [(t.label, t.kind) for t in snap.temperatures] == [("cpu-0-0-usr", "simulated"), ("skin-therm", "simulated")]
    assert [(trip.type, trip.temp_c) for trip in snap.temperatures[1].trips] == [("passive", 43.0)]
    assert snap.cpu.freq_ratio == 1.0
    assert snap.cpu.throttled is False
    assert snap.memory.total_bytes == 7680 * MB
    assert snap.battery is not None
    assert snap.battery.percent == pytest.approx(80.0)


def test_the_pi_throttles_under_load_and_recovers_only_below_trip_minus_hysteresis() -> None:
    workload = WorkloadSpec(
        name="load-then-rest",
        phase=(
            PhaseSpec(kind="chat", duration_s=900, think_s=(0.0, 0.0), answer_tokens=(400.0, 400.0)),
            PhaseSpec(kind="idle", duration_s=600),
        ),
    )
    world = World(PI, workload, record_s=0.5)
    run_full(world, 1500.0)
    s = world.series
    throttled = [i for i, f in enumerate(s.freq_ratio) if f < 1.0]
    assert throttled
    first = throttled[0]
    assert max(s.die_c[:first]) >= 80.0  # the trip was reached before the first step down
    assert max(s.die_c[: first - 2]) < 80.0  # and not long before: the kernel polls every 0.5 s
    assert min(s.freq_ratio) <= PI.cpu.freq_steps[3]
    assert s.freq_ratio[-1] == 1.0  # back to full clock after the rest
    last = throttled[-1]
    assert s.die_c[last] < 80.0 - 3.0  # the last steps back happen below trip - hysteresis
    assert max(s.die_c[last - 1 :]) < 80.0 - 3.0
    assert max(s.die_c) < 85.5  # the soft trip held it near 80: the hard limit barely (or never) engaged


def test_a_prompt_larger_than_the_context_fails_and_the_chat_goes_on() -> None:
    workload = WorkloadSpec(
        name="huge", phase=(PhaseSpec(kind="chat", duration_s=300, prompt_tokens=(3000.0, 3000.0), think_s=(5.0, 5.0)),)
    )
    world = World(PI, workload)
    run_full(world, 300.0)  # n_ctx 2048 < 3000: llama.cpp refuses each prompt, the user asks again
    assert world.engine.stats.failed >= 10
    assert world.engine.stats.tokens == 0


def test_a_zone_at_its_critical_trip_powers_the_device_off_for_the_rest_of_the_run() -> None:
    """The kernel's critical trip is a shutdown (hw_protection_shutdown): the answer in progress and every question
    after fail, no more tokens, no more power, and the device cools."""
    zone = PI.zone[0]
    # (under its passive trip: the kernel's throttling does not hold it off)
    trips = (*(t for t in zone.trip if t.type == "passive"), zone.trip[-1].model_copy(update={"temp_c": 79.0}))
    device = PI.model_copy(update={"zone": (zone.model_copy(update={"trip": trips}),)})
    chat = PhaseSpec(kind="chat", duration_s=1800, think_s=(5.0, 5.0), answer_tokens=(400.0, 400.0))
    workload = WorkloadSpec(name="c", phase=(chat,))
    world = World(device, workload, record_s=0.5)
    run_full(world, 900.0)
    assert world.off_s is not None
    off = world.series.t.index(world.off_s)  # (a poll on the record grid)
    assert world.series.die_c[off] >= 79.0
    assert all(r == 0.0 for r in world.series.tokens_per_s[off + 1 :])
    assert all(p == 0.0 for p in world.series.power_w[off + 1 :])
    assert world.series.die_c[-1] < 50.0  # off for minutes: toward the room
    failed, answers = world.engine.stats.failed, world.engine.stats.answers
    run_full(world, 960.0)
    assert world.engine.stats.failed >= failed + 5  # each question asked fails
    assert world.engine.stats.answers == answers
    spared = World(PI, workload, record_s=0.5)  # the Pi's own critical trip, 110 °C: never reached
    run_full(spared, 900.0)
    assert spared.off_s is None
    assert spared.engine.stats.failed == 0


def test_an_x86_cpus_own_thermal_control_holds_its_limit_under_the_kernels_view() -> None:
    """TCC at TjMax duty-cycles the cores: the die stays at the limit, under a critical trip the kernel's lowest step
    could not keep it from, the clock the sensors see falls, and the kernel does not count it as its throttling."""
    zone = PI.zone[0]
    passive, critical = (zone.trip[0].model_copy(update={"temp_c": 82.0, "max_state": None}),
                         zone.trip[-1].model_copy(update={"temp_c": 84.0}))  # fmt: skip
    shallow = PI.model_copy(  # one clock step: the kernel's throttling cannot hold 84 °C
        update={"zone": (zone.model_copy(update={"trip": (passive, critical)}),),
                "cpu": PI.cpu.model_copy(update={"freq_steps": (1.0, 0.95)})}
    )  # fmt: skip
    chat = PhaseSpec(kind="chat", duration_s=1800, think_s=(0.0, 0.0), answer_tokens=(400.0, 400.0))
    workload = WorkloadSpec(name="c", phase=(chat,))
    tcc = shallow.model_copy(update={"cpu": shallow.cpu.model_copy(update={"hw_limit_c": 80.0})})
    held = World(tcc, workload, record_s=0.5)
    run_full(held, 900.0)
    assert held.off_s is None
    assert max(held.series.die_c) < 82.0
    assert min(held.series.freq_ratio) < 1.0
    snap = held.snapshot()
    assert snap.cpu.throttled is False
    assert snap.cpu.freq_ratio is not None
    assert snap.cpu.freq_ratio < 1.0
    assert held.engine.stats.tokens > 0
    alone = World(shallow, workload, record_s=0.5)  # no such control: off at 84 °C
    run_full(alone, 900.0)
    assert alone.off_s is not None
