"""The lab's llama-server (EngineSpec.kind, issue 30): a setting it fixes at start costs a restart after the answer in
progress, the conversation restored where llama.cpp can load the slot and evaluated again where it cannot, and the
rate cap stays live; the shipped policies still beat the ungoverned server in the long chat."""

from __future__ import annotations

import pytest

from governor.lab.catalog import load_device
from governor.lab.deciders import NONE, decider_for, load_run
from governor.lab.engine import EngineSim
from governor.lab.experiment import simulate
from governor.lab.workload import Request, load_workload
from policies.decision import EngineConfig

PI = load_device("raspberry-pi-5", "llama-server")
SMALL = PI.engine.model[1]
DT = 0.25
BASE = EngineConfig(threads=4, n_ctx=4096, model=SMALL.name)


def answered(engine: EngineSim, t: float, prompt: int = 1000, answer: int = 200, *, new: bool = True) -> float:
    """One turn served to its end; returns the time it ended."""
    engine.submit(Request(t, prompt_tokens=prompt, answer_tokens=answer, new_conversation=new, system_tokens=100))
    while engine.busy():
        engine.step(t, DT, 1.0)
        t += DT
    return t


def test_a_threads_change_waits_for_the_answer_then_restarts_with_the_slot_restored() -> None:
    e = EngineSim(PI.engine, PI.cpu)
    e.apply(BASE, 0.0)
    e.submit(Request(0.0, prompt_tokens=1000, answer_tokens=400, new_conversation=True, system_tokens=100))
    t = 0.0
    while e.stats.tokens < 50:
        e.step(t, DT, 1.0)
        t += DT
    e.apply(BASE.model_copy(update={"threads": 2}), t)
    assert e.config == BASE  # the answer in progress goes on unchanged (the slot's save waits for it)
    while e.busy():
        e.step(t, DT, 1.0)
        t += DT
    e.step(t, DT, 1.0)  # the next step finds no answer: the restart goes now
    assert e.config is not None
    assert e.config.threads == 2
    assert (e.stats.restarts, e.stats.restores) == (1, 1)
    assert e.chat.ctx == pytest.approx(1500)  # the conversation kept: nothing to evaluate again
    assert e.chat.pending_tokens() == 0
    assert e.ready_s > t  # the server's start, the weights from the page cache, the slot read back
    assert e.stats.tokens == pytest.approx(400)


def test_a_kv_change_restarts_and_the_conversation_is_evaluated_again() -> None:
    e = EngineSim(PI.engine, PI.cpu)
    e.apply(BASE, 0.0)
    t = answered(e, 0.0)
    e.apply(BASE.model_copy(update={"kv_type": "q8_0"}), t)

    assert (e.stats.restarts, e.stats.restores) == (1, 0)
    assert e.chat.ctx == 0
    assert e.chat.pending_tokens() == pytest.approx(1300)  # the next turn evaluates it first


def test_the_rate_cap_is_live_no_restart() -> None:
    e = EngineSim(PI.engine, PI.cpu)
    e.apply(BASE, 0.0)
    t = answered(e, 0.0)
    e.apply(BASE.model_copy(update={"max_tokens_per_s": 3.0}), t)

    assert e.stats.restarts == 0
    assert e.config is not None
    assert e.config.max_tokens_per_s == 3.0


def test_the_built_in_engine_changes_threads_without_a_restart() -> None:
    e = EngineSim(load_device("raspberry-pi-5").engine, PI.cpu)
    e.apply(BASE, 0.0)
    t = answered(e, 0.0)
    e.apply(BASE.model_copy(update={"threads": 2}), t)

    assert e.stats.restarts == 0
    assert e.ready_s <= t


@pytest.mark.slow
def test_governed_beats_the_ungoverned_server_in_the_phones_long_chat_paying_its_restarts() -> None:
    phone = load_device("phone", "llama-server")
    workload = load_workload("long-chat")
    runs = {
        name: simulate(phone, decider_for(load_run(name), phone), workload, policy_name=name).summary
        for name in (NONE, "android-termux")
    }

    governed, none = runs["android-termux"], runs[NONE]
    assert governed.restarts > 0  # the policy changed settings the server fixes at start
    assert 0 < governed.restores <= governed.restarts  # threads: restored; a KV or model change: evaluated again
    assert governed.tokens >= none.tokens
    assert governed.j_per_token is not None
    assert none.j_per_token is not None
    assert governed.j_per_token < none.j_per_token
