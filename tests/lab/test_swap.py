"""The simulated engine's KV type change mid-answer follows the real engine's warm swap (issue 11 point 6): built
beside the answering context with half the threads where memory allows (no pause, both contexts' memory meanwhile),
else cold (the answer stops while its context is evaluated again)."""

from __future__ import annotations

import pytest

from governor.engine.plan import second_context_bytes
from governor.lab.catalog import load_device
from governor.lab.device import MB
from governor.lab.engine import EngineSim
from governor.lab.workload import Request
from policies.decision import EngineConfig

PI = load_device("raspberry-pi-5")
SMALL = PI.engine.model[1]  # llama-3.2-1b: decode at 2 threads is compute-bound (7.6 tok/s), at 4 bandwidth-bound
DT = 0.25
F16 = EngineConfig(threads=4, n_ctx=4096, model=SMALL.name)
Q8 = F16.model_copy(update={"kv_type": "q8_0"})
NEED = second_context_bytes(SMALL.footprint(), Q8)  # the second context's KV cache and compute buffer


class Answer:
    """One long answer (1,100 prompt tokens, 600 answer tokens) on an engine given `room` bytes by other programs."""

    def __init__(self, base: EngineConfig = F16, room: float = float("inf")) -> None:
        self.engine = EngineSim(PI.engine, PI.cpu)
        self.engine.apply(base, 0.0)
        self.engine.memory_left(room, 0.0)
        first = Request(0.0, prompt_tokens=1000, answer_tokens=600, new_conversation=True, system_tokens=100)
        self.engine.submit(first)
        self.t = 0.0
        self.stalls = 0  # steps of the answer, after its first token, that gave no token

    def step(self) -> None:
        e = self.engine
        before = e.stats.tokens
        e.step(self.t, DT, 1.0)
        self.t += DT
        if e.answering.current is not None and e.stats.tokens == before and e.stats.ttft_s:
            self.stalls += 1

    def until(self, tokens: float) -> None:
        while self.engine.stats.tokens < tokens:
            self.step()

    def to_end(self) -> None:
        while self.engine.busy():
            self.step()


def test_a_kv_change_mid_answer_is_built_warm_beside_it_and_the_answer_never_stops() -> None:
    a = Answer()
    a.until(100)
    e = a.engine
    alone = e.resident_bytes()
    full_speed = e.uncapped_tokens_per_s
    e.apply(Q8, a.t)
    changed, cached = a.t, e.chat.ctx
    assert e.config == F16  # the answer goes on in the old context meanwhile
    assert e.resident_bytes() == pytest.approx(alone + NEED, abs=1)  # both contexts' memory
    a.step()
    assert e.uncapped_tokens_per_s == pytest.approx(2 * SMALL.thread_tok_s)  # half of the 4 threads
    assert full_speed is not None
    assert full_speed > 1.3 * 2 * SMALL.thread_tok_s  # at 4 threads: the bandwidth-bound speed
    while e.config != Q8:
        a.step()
    assert (e.stats.warm_swaps, e.stats.reloads) == (1, 2)  # the first load, the swap
    assert e.resident_bytes() == pytest.approx(PI.engine.footprint_bytes(SMALL, 4096, "q8_0", 512), abs=1)
    # the build (context_s), the answer so far prefilled with 2 threads, then the catch-up rounds (~400 tokens)
    prefill = PI.engine.context_s + cached / (2 * SMALL.prefill_thread_tok_s)
    assert prefill < a.t - changed < prefill + 20
    a.to_end()
    assert a.stalls == 0
    assert e.stats.tokens == pytest.approx(600)
    assert (e.stats.answers, e.stats.failed, e.stats.truncated) == (1, 0, 0)


def test_a_kv_change_is_cold_when_memory_would_not_leave_the_reserve_and_the_answer_stops() -> None:
    footprint = PI.engine.footprint_bytes(SMALL, 4096, "f16", 512)
    room = footprint + NEED + 200 * MB  # a second context would leave 200 MiB: less than the 256 MiB reserve
    a = Answer(room=room)
    a.until(100)
    e = a.engine
    e.apply(Q8, a.t)
    assert e.config == Q8
    assert e.stats.cold_why == ["348 MiB more would leave less than 256 MiB of 548"]
    peak = 0
    while e.busy():
        a.step()
        peak = max(peak, e.resident_bytes())
    assert peak <= footprint  # never two contexts
    assert (e.stats.warm_swaps, e.stats.reloads) == (0, 2)  # the first load, the cold reload
    # the answer waits while its 1,200 tokens are evaluated again at 4 threads
    assert a.stalls * DT == pytest.approx(1200 / (4 * SMALL.prefill_thread_tok_s) + PI.engine.context_s, abs=2 * DT)
    assert e.stats.tokens == pytest.approx(600)


def test_a_kv_change_on_one_thread_is_cold() -> None:
    a = Answer(F16.model_copy(update={"threads": 1}))
    a.until(50)
    a.engine.apply(Q8.model_copy(update={"threads": 1}), a.t)
    assert a.engine.stats.cold_why == ["one thread: nothing to split"]
    a.to_end()
    assert a.stalls > 0
    assert a.engine.stats.warm_swaps == 0


def test_the_oom_rule_sees_both_contexts_during_the_swap() -> None:
    a = Answer()
    a.until(100)
    e = a.engine
    room = e.unreclaimable_bytes() + NEED / 2  # enough for one context, not for two
    e.memory_left(room, a.t)
    assert e.stats.oom_kills == 0
    e.memory_left(float("inf"), a.t)
    e.apply(Q8, a.t)
    e.memory_left(room, a.t)  # other programs grew after the engine decided
    assert (e.stats.oom_kills, e.stats.failed) == (1, 1)
    assert e.config == Q8  # the daemon starts it again with the change


def test_a_newer_change_waits_for_the_build_and_applies_on_top() -> None:
    a = Answer()
    a.until(100)
    e = a.engine
    e.apply(Q8, a.t)
    a.until(110)
    smaller = Q8.model_copy(update={"n_ctx": 3072})
    e.apply(smaller, a.t)
    tokens = e.stats.tokens
    while e.config != smaller:
        a.step()
        if e.config != smaller:
            assert e.stats.tokens == tokens  # the answer waits for the build, as the real worker does
    assert (e.stats.warm_swaps, e.stats.resizes) == (1, 1)  # switched, then the n_ctx change copied the cache
    a.to_end()
    assert e.stats.tokens == pytest.approx(600)


def test_a_pause_during_the_swap_cancels_it_and_the_change_applies_at_the_next_load() -> None:
    a = Answer()
    a.until(100)
    e = a.engine
    e.apply(Q8, a.t)
    a.until(120)
    e.wait("no tier fits in 900 MiB; waiting for memory", a.t)
    assert e.paused
    assert e.resident_bytes() == PI.engine.overhead_mb * MB
    assert e.config == Q8
    for _ in range(8):
        a.step()
    e.wait(None, a.t)
    a.to_end()
    assert (e.stats.warm_swaps, e.stats.reloads, e.stats.failed) == (0, 2, 0)  # the first load, the resume
    assert e.stats.tokens == pytest.approx(600)


def test_an_answer_that_ends_during_the_swap_leaves_the_conversation_in_the_new_cache() -> None:
    a = Answer()
    a.until(590)
    e = a.engine
    e.apply(Q8, a.t)
    a.to_end()  # the answer ended, then the build: busy until the switch
    assert e.config == Q8
    assert e.stats.warm_swaps == 1
    gap = e.chat.pending_tokens()  # the answer's last tokens, which came after the swap's last round
    assert e.chat.ctx + gap == pytest.approx(1700)  # the whole conversation: cached or to evaluate
    assert gap < 3
    prefilled = e.stats.prefill_tokens
    e.submit(Request(a.t, prompt_tokens=50, answer_tokens=10, new_conversation=False, system_tokens=100))
    a.to_end()
    assert e.stats.prefill_tokens - prefilled == pytest.approx(50 + gap)  # prefix reuse in the new cache
