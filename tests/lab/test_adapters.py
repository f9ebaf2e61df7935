"""The simulated engine knows LoRA adapters (issue 32): a switch costs its measured time and the other adapter's cache,
a miss also the file's read, a small pool evicts and counts in memory, an adapter larger than the pool fails; the
policy's memory fit sizes the pool in the lab as on a device; a workload draws adapters only when it names some."""

from __future__ import annotations

import pytest

from governor.lab.catalog import load_device
from governor.lab.device import MB, SimAdapterSpec
from governor.lab.engine import EngineSim
from governor.lab.workload import Driver, PhaseSpec, Request, WorkloadSpec
from policies.decision import EngineConfig

PI = load_device("raspberry-pi-5")
ENGINE = PI.engine.model_copy(
    update={"adapter": tuple(SimAdapterSpec(name=n, size_mb=30.0) for n in ("a", "b", "c")), "adapter_switch_s": 0.03}
)
BIG = PI.engine.model[0].name


def engine_with(pool_mib: float) -> EngineSim:
    engine = EngineSim(ENGINE, PI.cpu)
    engine.apply(EngineConfig(threads=4, n_ctx=2048, model=BIG, lora_pool_mib=pool_mib), 0.0)
    return engine


def turn(engine: EngineSim, t: float, adapter: str | None, *, prompt: int = 50, answer: int = 50) -> float:
    request = Request(t, prompt, answer, new_conversation=False, system_tokens=0, adapter=adapter)
    engine.submit(request)
    while engine.busy():
        engine.step(t, 0.05, 1.0)
        t += 0.05
    return t


def test_the_same_adapter_again_costs_nothing_a_switch_costs_its_time_and_the_cache() -> None:
    engine, t = engine_with(128), 0.0
    t = turn(engine, t, "a")  # a miss: read from storage
    first = engine.stats.prefill_tokens
    t = turn(engine, t, "a")
    assert engine.stats.prefill_tokens - first == pytest.approx(50)  # only the new prompt: the cache is a's
    assert (engine.pool.stats.hits, engine.pool.stats.misses) == (1, 1)
    before = engine.stats.prefill_tokens
    t = turn(engine, t, None)  # back to the base model: the cache (200 tokens) was a's
    assert engine.stats.prefill_tokens - before == pytest.approx(200 + 50)
    assert engine.pool.stats.switches == 2


def test_a_small_pool_evicts_counts_in_memory_and_refuses_what_cannot_fit() -> None:
    engine, t = engine_with(64), 0.0  # 64 MiB: two 30 MiB adapters
    for name in ("a", "b", "c", "a"):
        t = turn(engine, t, name)
        assert engine.pool.held_bytes() <= 64 * MB
    assert (engine.pool.stats.misses, engine.pool.stats.evictions) == (4, 2)  # a came back after c pushed it out
    assert engine.resident_bytes() >= engine.footprint_bytes() - engine.pool.held_bytes() + 60 * MB - 1
    engine.apply(EngineConfig(threads=4, n_ctx=2048, model=BIG, lora_pool_mib=16), t)  # the policy shrinks it
    assert engine.pool.held_bytes() <= 30 * MB  # only the adapter in use stays
    failed = engine.stats.failed
    t = turn(engine, t, "b")  # 30 MiB > 16 MiB: the engine answers 503
    assert (engine.stats.failed, engine.pool.stats.refused) == (failed + 1, 1)


def test_a_miss_from_storage_takes_longer_than_from_the_page_cache_and_a_hit_least() -> None:
    waits = {}
    for case, pool in (("storage", 128.0), ("page cache", 31.0), ("hit", 128.0)):
        engine, t = engine_with(pool), 0.0
        t = turn(engine, t, "a")
        t = turn(engine, t, "b")  # pool 31: evicts a (still in the page cache)
        t = turn(engine, t, None)
        start = t
        name = "c" if case == "storage" else "a"
        request = Request(t, 50, 5, new_conversation=True, system_tokens=0, adapter=name)
        engine.submit(request)
        while engine.busy():
            engine.step(t, 0.01, 1.0)
            t += 0.01
        assert request.first_token_s is not None
        waits[case] = request.first_token_s - start
    assert waits["hit"] < waits["page cache"] < waits["storage"]
    assert waits["storage"] - waits["hit"] == pytest.approx(30 / ENGINE.load_mb_s, rel=0.2)  # 30 MiB at its speed


def test_a_workload_draws_adapters_only_when_it_names_some() -> None:
    plain = WorkloadSpec(name="w", phase=(PhaseSpec(kind="poisson", duration_s=3600, rate_per_h=600),))
    mixed = plain.model_copy(
        update={"phase": (plain.phase[0].model_copy(update={"adapter_mix": {"a": 0.5, "b": 0.25}}),)}
    )
    drawn = Driver(mixed, seed=1).arrivals(3600)
    names = [r.adapter for r in drawn]
    assert 0.4 < names.count("a") / len(names) < 0.6
    assert 0.15 < names.count("b") / len(names) < 0.35
    assert None in names
    assert all(r.adapter is None for r in Driver(plain, seed=1).arrivals(3600))
    with pytest.raises(ValueError, match="adapter_mix weights"):
        PhaseSpec(kind="poisson", duration_s=10, adapter_mix={"a": 0.8, "b": 0.4})
