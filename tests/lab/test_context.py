"""The simulated engine follows the real engine's context rules (issue 11): a context shift keeps the cache, a turn
evaluates only its new tokens, an n_ctx change keeps the cache, a KV type or model change evaluates it again."""

from __future__ import annotations

import pytest

from governor.lab.catalog import load_device
from governor.lab.conversation import Conversation
from governor.lab.engine import EngineSim
from governor.lab.stats import batch_efficiency
from governor.lab.workload import Request
from policies.decision import EngineConfig

PI = load_device("raspberry-pi-5")
BIG, SMALL = PI.engine.model[0], PI.engine.model[1]


def turn(engine: EngineSim, t: float, prompt: int, answer: int) -> float:
    """One chat turn, run to its end; returns the time it ended."""
    engine.submit(Request(t, prompt_tokens=prompt, answer_tokens=answer, new_conversation=False, system_tokens=0))
    while engine.busy():
        engine.step(t, 0.25, 1.0)
        t += 0.25
    return t


def engine_at(n_ctx: int, model: str = BIG.name) -> EngineSim:
    engine = EngineSim(PI.engine, PI.cpu)
    engine.apply(EngineConfig(threads=4, n_ctx=n_ctx, model=model), 0.0)
    return engine


def test_a_chat_outgrowing_the_context_shifts_it_and_evaluates_only_new_prompts() -> None:
    engine, t = engine_at(1024), 0.0
    for _ in range(12):  # 12 x 300 tokens: outgrows 1024 several times
        t = turn(engine, t, prompt=100, answer=200)
    assert engine.stats.shifts >= 3
    assert engine.stats.prefill_tokens == pytest.approx(12 * 100)  # never the history again
    assert engine.stats.truncated == 0
    assert engine.stats.tokens == pytest.approx(12 * 200)
    assert engine.chat.ctx <= 1024
    ttft = engine.stats.ttft_s[1:]  # the first waited for the load
    assert max(ttft) < 1.2 * min(ttft)  # a turn after a shift costs what any other does (the same prompt size)


def test_an_n_ctx_change_keeps_the_cache_and_a_kv_change_evaluates_it_again() -> None:
    engine, t = engine_at(2048), 0.0
    t = turn(engine, t, prompt=100, answer=300)
    engine.apply(EngineConfig(threads=4, n_ctx=1024, model=BIG.name), t)  # still fits: copied as it is
    assert (engine.stats.reloads, engine.stats.resizes) == (1, 1)
    assert engine.chat.ctx == pytest.approx(400)
    t = turn(engine, t, prompt=100, answer=300)
    assert engine.stats.prefill_tokens == pytest.approx(200)
    engine.apply(EngineConfig(threads=4, n_ctx=512, model=BIG.name), t)  # 800 cached > 512: evaluated again
    assert (engine.stats.reloads, engine.stats.resizes) == (2, 1)
    t = turn(engine, t, prompt=50, answer=100)
    assert engine.stats.prefill_tokens == pytest.approx(200 + 256 + 50)  # the newest half of the new context
    kept = min(engine.chat.ctx, 256)  # the newest half of the context
    engine.apply(EngineConfig(threads=4, n_ctx=512, kv_type="q8_0", model=BIG.name), t)  # new cache: evaluated again
    t = turn(engine, t, prompt=50, answer=100)
    assert engine.stats.reloads == 3
    assert engine.stats.prefill_tokens == pytest.approx(200 + 256 + 50 + kept + 50)


def test_an_n_ctx_change_costs_a_context_and_a_model_change_a_load() -> None:
    engine, t = engine_at(2048), 0.0
    t = turn(engine, t, prompt=100, answer=100)
    engine.apply(EngineConfig(threads=4, n_ctx=1024, model=BIG.name), t)
    assert engine.ready_s == pytest.approx(t + PI.engine.context_s)
    engine.apply(EngineConfig(threads=4, n_ctx=1024, model=SMALL.name), t)
    assert engine.ready_s == pytest.approx(t + PI.engine.context_s + SMALL.weights_mb / PI.engine.load_mb_s)


def test_a_smaller_n_batch_takes_less_memory_and_evaluates_prompts_slower_keeping_the_cache() -> None:
    engine, t = engine_at(2048, SMALL.name), 0.0
    t = turn(engine, t, prompt=400, answer=100)
    full_fp = engine.footprint_bytes()
    engine.apply(EngineConfig(threads=4, n_ctx=2048, model=SMALL.name, n_batch=64), t)
    assert (engine.stats.reloads, engine.stats.resizes) == (1, 1)  # a new context, the cache copied
    fp = SMALL.footprint()
    assert full_fp - engine.footprint_bytes() == pytest.approx(fp.compute_bytes(2048, 512) - fp.compute_bytes(2048, 64))
    t = turn(engine, t + 1.0, prompt=400, answer=100)
    assert engine.stats.prefill_tokens == pytest.approx(800)  # only the new prompt
    assert batch_efficiency(64) < 0.75 < batch_efficiency(512) == 1.0
    evaluation = 400 / (4 * SMALL.prefill_thread_tok_s * batch_efficiency(64))
    assert engine.stats.ttft_s[-1] == pytest.approx(evaluation, rel=0.1)


def test_a_cache_and_a_pending_tail_that_outgrow_the_context_shift_the_cache_rather_than_fail() -> None:
    """After a warm swap the new context may hold all but the last tokens of the answer (`pending`): the next turn
    shifts what is cached, as the real engine's prefix reuse does, and answers (issue 27's fleet: the turn failed as
    a prompt that alone does not fit, 7 cells of 1000)."""
    chat = Conversation(ctx=490.0, history=491.0, pending=1.0)
    prefill, shifts = chat.begin(Request(0.0, 128, 200, new_conversation=False, system_tokens=0), n_ctx=512)
    assert shifts >= 1
    assert prefill == 129  # the pending tail, then the prompt
    assert chat.ctx + prefill < 512  # the answer starts (answering.py fails a turn whose prompt alone does not fit)


def test_a_pending_conversation_after_a_reload_is_trimmed_to_half_the_context() -> None:
    chat = Conversation(ctx=0.0, history=900.0, pending=900.0)
    prefill, shifts = chat.begin(Request(0.0, 100, 200, new_conversation=False, system_tokens=0), n_ctx=512)
    assert (prefill, shifts) == (256, 0)
