"""Memory fit from real GGUF headers written with the `gguf` package, and the governor choosing tiers with it."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from policies import ModelFootprint, StateMachine
from policies.decision import KV_BYTES_PER_ELEMENT, State
from policies.ladder import LoraAdapter, ModelLadder, ModelTier
from policies.memfit import MIB, Candidate, MemFitError, fit
from policies.schema import Memory
from sensors.snapshot import EngineObservation
from tests.policies.builders import BUSY, IDLE, run, snap
from tests.policies.conftest import make_policy


def write_gguf(
    path: Path,
    *,
    layers: int = 4,
    embd: int = 256,
    heads: int = 8,
    kv_heads: int = 4,
    vocab: int = 300,
    padding_bytes: int = 0,
    key_length: int | None = None,
) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(embd)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if key_length is not None:
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_tensor("pad", np.zeros(max(1, padding_bytes // 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_footprint_reads_the_header(tmp_path: Path) -> None:
    fp = ModelFootprint.from_gguf(write_gguf(tmp_path / "m.gguf", padding_bytes=4096))
    assert (fp.n_layer, fp.n_embd, fp.n_head, fp.n_head_kv, fp.n_vocab) == (4, 256, 8, 4, 300)
    assert (fp.head_dim_k, fp.head_dim_v) == (32, 32)  # embd / heads when the header has no key_length
    assert fp.file_bytes == (tmp_path / "m.gguf").stat().st_size > 4096
    assert fp.quantized_kv_ok


def test_footprint_uses_explicit_key_length(tmp_path: Path) -> None:
    fp = ModelFootprint.from_gguf(write_gguf(tmp_path / "m.gguf", key_length=80))
    assert (fp.head_dim_k, fp.head_dim_v) == (80, 80)
    assert not fp.quantized_kv_ok


def test_not_a_gguf_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(MemFitError, match=r"bad\.gguf: cannot read GGUF header"):
        ModelFootprint.from_gguf(bad)


FP = ModelFootprint(
    file_bytes=400 * MIB, n_layer=24, n_embd=2048, n_head=16, n_head_kv=8, head_dim_k=128, head_dim_v=128, n_vocab=32000
)
SMALL = ModelFootprint(
    file_bytes=100 * MIB, n_layer=12, n_embd=1024, n_head=8, n_head_kv=4, head_dim_k=128, head_dim_v=128, n_vocab=32000
)
MEM = Memory(overhead_mb=0.0, min_ctx=512, ctx_multiple=256)


def test_kv_and_compute_formulas() -> None:
    assert FP.kv_bytes(4096, "f16") == 4096 * 256 * 8 * 24 * 2
    assert FP.kv_bytes(4096, "q8_0") == 4096 * 256 * 8 * 24 * KV_BYTES_PER_ELEMENT["q8_0"]
    b = 512
    assert FP.compute_bytes(4096, 512) == max(4 * b * (1 + 4 * 2048 + 4096 * 17), 4 * b * (2048 + 32000))


def candidates() -> list[Candidate]:
    return [Candidate("big", FP, 8192, True), Candidate("small", SMALL, 8192, True)]


def test_fit_keeps_the_profile_when_memory_is_plenty() -> None:
    got = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=4096 * MIB, memory=MEM)
    assert (got.model, got.n_ctx, got.kv_type, got.bound) == ("big", 4096, "f16", "profile")


def test_fit_quantises_kv_before_shrinking_context() -> None:
    need_f16 = FP.total_bytes(4096, "f16", MEM)
    need_q8 = FP.total_bytes(4096, "q8_0", MEM)
    got = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=(need_f16 + need_q8) / 2, memory=MEM)
    assert (got.model, got.n_ctx, got.kv_type, got.bound) == ("big", 4096, "q8_0", "memory")


def test_fit_shrinks_context_to_the_largest_that_fits() -> None:
    budget = FP.total_bytes(1800, "q4_0", MEM)
    got = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=budget, memory=MEM)
    assert got.model == "big"
    assert got.bound == "memory"
    assert got.n_ctx == 1792  # a multiple of 256 under 1800
    assert got.bytes <= budget


def test_fit_drops_a_tier_when_the_big_one_cannot_fit() -> None:
    got = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=300 * MIB, memory=MEM)
    assert got.model == "small"
    assert got.bound == "memory"


def test_fit_lowers_n_batch_before_dropping_a_tier() -> None:
    at_512, at_128 = FP.total_bytes(512, "q4_0", MEM), FP.total_bytes(512, "q4_0", MEM, n_batch=128)
    assert at_512 - at_128 == FP.compute_bytes(512, 512) - FP.compute_bytes(512, 128)  # the compute buffer
    budget = FP.total_bytes(512, "q4_0", MEM, n_batch=256) - MIB  # 256 just misses
    got = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=budget, memory=MEM)
    assert (got.model, got.kv_type, got.n_batch, got.bound) == ("big", "q4_0", 128, "memory")
    assert got.n_ctx >= 512
    assert at_128 <= got.bytes <= budget
    tight = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=at_128 - MIB, memory=MEM)
    assert (tight.model, tight.n_batch) == ("big", 64)  # halved down to min_n_batch
    none = Memory(overhead_mb=0.0, min_ctx=512, ctx_multiple=256, min_n_batch=512)
    assert fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=at_128, memory=none).model == "small"


def test_fit_reports_when_nothing_fits() -> None:
    got = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=10 * MIB, memory=MEM)
    assert (got.model, got.n_ctx, got.kv_type, got.bound) == ("small", 512, "q4_0", "nothing fits")


def test_quantised_kv_falls_back_to_f16_when_the_engine_cannot() -> None:
    odd = ModelFootprint(
        file_bytes=MIB, n_layer=2, n_embd=160, n_head=2, n_head_kv=2, head_dim_k=80, head_dim_v=80, n_vocab=100
    )
    got = fit([Candidate("odd", odd, 2048, True)], max_ctx=2048, kv_type="q8_0", budget_bytes=None, memory=MEM)
    assert got.kv_type == "f16"
    assert "head_dim 80/80" in got.note
    assert "using f16" in got.note
    no_fa = fit([Candidate("nofa", FP, 2048, False)], max_ctx=2048, kv_type="q4_0", budget_bytes=None, memory=MEM)
    assert no_fa.kv_type == "f16"
    assert "flash_attn False" in no_fa.note


def test_the_lora_pool_counts_and_gives_way_before_kv_type_context_or_tier() -> None:
    pooled = Memory(overhead_mb=0.0, min_ctx=512, ctx_multiple=256, lora_pool_mib=64.0, min_lora_pool_mib=8.0)
    top = FP.total_bytes(4096, "f16", pooled)

    roomy = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=top + 100 * MIB, memory=pooled, adapters=True)
    assert (roomy.n_ctx, roomy.kv_type, roomy.pool_bytes, roomy.bound) == (4096, "f16", 64 * MIB, "profile")
    assert roomy.bytes == top + 64 * MIB  # the pool is engine memory

    short = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=top + 20.5 * MIB, memory=pooled, adapters=True)
    assert (short.model, short.n_ctx, short.kv_type) == ("big", 4096, "f16")  # nothing else gave way ...
    assert (short.pool_bytes, short.bound) == (20 * MIB, "memory")  # ... the pool did (in whole MiB)

    tighter = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=top, memory=pooled, adapters=True)
    assert tighter.pool_bytes == 8 * MIB  # at its floor: now the KV type goes
    assert (tighter.n_ctx, tighter.kv_type) == (4096, "q8_0")
    assert tighter.bytes <= top

    without = fit(candidates(), max_ctx=4096, kv_type="f16", budget_bytes=top, memory=pooled)
    assert (without.pool_bytes, without.kv_type, without.bound) == (0.0, "f16", "profile")  # no adapters: no pool


def ladder_governor(tmp_path: Path) -> StateMachine:
    big = write_gguf(tmp_path / "big.gguf", layers=8, embd=512, heads=8, kv_heads=8, padding_bytes=60 * MIB)
    small = write_gguf(tmp_path / "small.gguf", layers=4, embd=256, heads=8, kv_heads=4, padding_bytes=10 * MIB)
    ladder = ModelLadder(
        tier=(ModelTier(name="big", path=big, n_ctx=8192), ModelTier(name="small", path=small, n_ctx=4096))
    )
    footprints = {t.name: ModelFootprint.from_gguf(t.path) for t in ladder.tiers}
    return StateMachine(
        make_policy(memory={"reserve_mb": 100.0, "overhead_mb": 20.0}), ladder=ladder, footprints=footprints
    )


def test_governor_picks_tiers_from_the_ladder_and_fits_memory(tmp_path: Path) -> None:
    gov = ladder_governor(tmp_path)
    roomy = gov.decide(snap(50.0, available_mb=4000), IDLE, 0.0)
    assert (roomy.engine.model, roomy.engine.n_ctx, roomy.engine.kv_type) == ("big", 4096, "f16")
    assert roomy.readings["fit_bound"] == "profile"
    tight = gov.decide(snap(50.0, available_mb=210), IDLE, 1.0)
    assert tight.engine.model == "big"
    assert tight.engine.n_ctx < 4096
    assert tight.rule == "memory.fit"
    assert "bound by memory" in tight.reason


def test_governor_grows_back_only_after_the_margin_and_a_step(tmp_path: Path) -> None:
    gov = ladder_governor(tmp_path)
    tight = gov.decide(snap(50.0, available_mb=210), IDLE, 0.0)
    wobble = gov.decide(snap(50.0, available_mb=240), IDLE, 1.0)  # +30 MiB < grow margin 64 MiB
    assert wobble.engine.n_ctx == tight.engine.n_ctx
    grown = run(gov, [snap(50.0, available_mb=4000)] * 12, t0=2.0, engine=IDLE)
    assert grown[-1].engine.n_ctx == 4096


def test_critical_takes_the_smallest_tier(tmp_path: Path) -> None:
    gov = ladder_governor(tmp_path)
    d = run(gov, [snap(95.0, available_mb=4000)] * 3, engine=BUSY)[-1]
    assert d.state == State.CRITICAL
    assert d.engine.model == "small"


def test_a_profile_naming_a_missing_tier_is_refused(tmp_path: Path) -> None:
    from policies import PolicyError

    ladder = ModelLadder(tier=(ModelTier(name="only", path=tmp_path / "x.gguf"),))
    with pytest.raises(PolicyError, match=r"states\.critical\.model: no tier 'tiny'"):
        StateMachine(make_policy(states={"critical": {"model": "tiny"}}), ladder=ladder)


def test_memory_pressure_shrinks_the_fitted_footprint(tmp_path: Path) -> None:
    gov = ladder_governor(tmp_path)
    calm = run(gov, [snap(50.0, available_mb=4000, psi=0.0)] * 2, engine=IDLE)[-1]
    squeezed = run(gov, [snap(50.0, available_mb=4000, psi=30.0)] * 12, t0=2.0, engine=IDLE)
    assert squeezed[0].rule == "memory.pressure"
    sizes = [(d.engine.model, d.engine.n_ctx, d.engine.kv_type) for d in squeezed]
    assert sizes[0] != (calm.engine.model, calm.engine.n_ctx, calm.engine.kv_type)
    assert len(set(sizes)) >= 2  # shrinks again while the pressure stays


def test_memory_the_engine_holds_counts_toward_the_budget(tmp_path: Path) -> None:
    gov = ladder_governor(tmp_path)
    loaded = EngineObservation(busy=False, model="big", rss_bytes=300 * MIB)
    d = gov.decide(snap(50.0, available_mb=210), loaded, 0.0)
    assert (d.engine.n_ctx, d.engine.kv_type, d.readings["fit_bound"]) == (4096, "f16", "profile")


def test_when_nothing_fits_the_decision_says_wait_and_memory_coming_back_ends_it(tmp_path: Path) -> None:
    gov = ladder_governor(tmp_path)
    wall = run(gov, [snap(50.0, available_mb=120)] * 3, engine=None)  # 120 - 100 reserve: 20 MiB for the engine
    assert wall[-1].engine_wait == "no tier fits in 20 MiB; waiting for memory"
    assert wall[-1].rule == "memory.wait"
    assert "no tier fits in 20 MiB; waiting for memory (small needs" in wall[-1].reason
    back = run(gov, [snap(50.0, available_mb=4000)] * 12, t0=3.0, engine=None)
    assert back[-1].engine_wait is None
    assert back[-1].engine.model == "big"


def test_the_governor_sizes_the_lora_pool_only_for_a_ladder_with_adapters(tmp_path: Path) -> None:
    gov = ladder_governor(tmp_path)
    assert gov.decide(snap(50.0, available_mb=4000), IDLE, 0.0).engine.lora_pool_mib == 0.0  # no adapters
    assert gov.ladder is not None
    ladder = gov.ladder.model_copy(
        update={"adapter": (LoraAdapter(name="french", path=tmp_path / "f.gguf", base="big"),)}
    )
    memory = {"reserve_mb": 100.0, "overhead_mb": 20.0, "lora_pool_mib": 32.0}
    pooled = StateMachine(make_policy(memory=memory), ladder=ladder, footprints=gov.footprints)
    roomy = pooled.decide(snap(50.0, available_mb=4000), IDLE, 0.0)
    assert (roomy.engine.lora_pool_mib, roomy.engine.n_ctx) == (32.0, 4096)
    tight = pooled.decide(snap(50.0, available_mb=210), IDLE, 1.0)
    assert tight.engine.lora_pool_mib == 0.0  # shrunk to its floor first ...
    assert "LoRA pool 32→0 MiB" in tight.reason  # ... and the reason says so


def test_the_lora_pool_comes_back_while_a_priced_reload_waits(tmp_path: Path) -> None:
    """Memory back after a squeeze: the larger context waits for its price, but the pool (a live setting, resized
    between answers) is not part of what waits: it grows back at once and stays (it was reset to 0 MiB)."""
    gov = ladder_governor(tmp_path)
    assert gov.ladder is not None
    ladder = gov.ladder.model_copy(
        update={"adapter": (LoraAdapter(name="french", path=tmp_path / "f.gguf", base="big"),)}
    )
    memory = {"reserve_mb": 100.0, "overhead_mb": 20.0, "lora_pool_mib": 32.0}
    pooled = StateMachine(
        make_policy(memory=memory, changes={"enabled": True}), ladder=ladder, footprints=gov.footprints
    )
    pooled.decide(snap(50.0, available_mb=4000), IDLE, 0.0)
    assert pooled.decide(snap(50.0, available_mb=150), IDLE, 1.0).engine.lora_pool_mib == 0.0
    waiting = [pooled.decide(snap(50.0, available_mb=4000), IDLE, float(t)) for t in range(2, 20)]
    assert all(d.engine.n_ctx == 768 for d in waiting)  # the reload waits its price ...
    assert [d.engine.lora_pool_mib for d in waiting] == [32.0] * len(waiting)  # ... the pool does not
    assert waiting[-1].rule == "change.priced"
