"""Reconfiguring a real engine process while it streams an answer: live (threads, rate cap) and by reload
(context, KV type, model), with trimming when the conversation no longer fits."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.governor.engine.engine_proc import Chunked, Engine, at_baseline, ladder_engine, user
from tests.helpers import eventually

pytestmark = pytest.mark.slow

# The small tier and one thread keep these tests light on a shared machine (llama.cpp's threads wait for each other
# at every step, so two threads on two busy cores can be 10x slower than one); a rate cap keeps answers streaming.
BASELINE: dict[str, Any] = {
    "model": "small",
    "n_ctx": 2048,
    "kv_type": "f16",
    "threads": 1,
    "max_tokens_per_s": None,
    "n_batch": 512,
    "lora_pool_mib": 64.0,
}


@pytest.fixture(scope="module")
def module_engine(demo_ladder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with ladder_engine(tmp_path_factory.mktemp("reconfig"), demo_ladder, "small") as eng:
        yield eng


@pytest.fixture
def engine(module_engine: Engine) -> Iterator[Engine]:
    """The module's engine, back at the baseline settings before and after each test."""
    with at_baseline(module_engine, BASELINE) as eng:
        yield eng


def long_answer(max_tokens: int, messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"model": "small", "messages": messages or user("go on"), "max_tokens": max_tokens, "ignore_eos": True}


def arrived(seen: Chunked, n: int) -> bool:
    return len(seen.arrivals) >= n


def assert_complete(seen: Chunked, max_tokens: int) -> None:
    assert seen.done, seen.chunks[-1:]
    assert not [c for c in seen.chunks if "error" in c]
    assert seen.finish_reason == "length"
    assert seen.usage is not None
    assert seen.usage["completion_tokens"] == max_tokens


def test_threads_change_live_mid_stream(engine: Engine) -> None:
    assert engine.config(max_tokens_per_s=40).status_code == 200
    thread, seen = engine.stream_in_thread(long_answer(80))
    eventually(lambda: arrived(seen, 3))
    r = engine.config(threads=2)
    assert r.status_code == 200, r.text
    assert r.json()["applied"] == "live"
    assert r.json()["config"]["threads"] == 2
    status = engine.status()
    assert status["threads"] == 2
    assert status["busy"] is True
    n_before = len(seen.arrivals)
    eventually(lambda: arrived(seen, n_before + 3))  # tokens keep coming with two threads
    thread.join(60)
    assert_complete(seen, 80)


def test_rate_cap_applies_mid_stream_and_lifts(engine: Engine) -> None:
    assert engine.config(max_tokens_per_s=100).status_code == 200
    thread, seen = engine.stream_in_thread(long_answer(200))
    eventually(lambda: arrived(seen, 2))
    assert engine.config(max_tokens_per_s=8).json()["applied"] == "live"
    capped_from = len(seen.arrivals) + 1  # one token may have been on its way
    eventually(lambda: arrived(seen, capped_from + 6), timeout_s=30)
    assert engine.status()["max_tokens_per_s"] == 8
    eventually(lambda: 0 < engine.status()["tokens_per_s"] <= 8 * 1.5, timeout_s=30)  # once the window is all capped
    capped = seen.arrivals[capped_from : capped_from + 6]
    gaps = [b - a for a, b in itertools.pairwise(capped)]
    assert statistics.median(gaps) >= 0.5 / 8  # loosely: the cap spaces tokens out
    assert engine.config(max_tokens_per_s=None).json()["config"]["max_tokens_per_s"] is None
    thread.join(60)
    assert_complete(seen, 200)


RELOADS: list[dict[str, Any]] = [
    {"n_ctx": 1024},
    {"n_batch": 64},  # issue 11: a smaller compute buffer under memory pressure
    {"kv_type": "q8_0"},
    {"kv_type": "q4_0", "n_ctx": 512},
    {"model": "medium"},
    {"model": "large", "kv_type": "q8_0"},
]


@pytest.mark.parametrize("change", RELOADS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_reload_mid_stream_continues_the_answer(engine: Engine, change: dict[str, Any]) -> None:
    reloads = engine.status()["reloads_total"]
    assert engine.config(max_tokens_per_s=30).status_code == 200
    thread, seen = engine.stream_in_thread(long_answer(60))
    eventually(lambda: arrived(seen, 5))
    r = engine.config(**change)
    assert r.status_code == 200, r.text
    assert r.json()["applied"] == "reload"
    assert r.json()["seconds"] > 0
    assert r.json()["config"] == {**BASELINE, "max_tokens_per_s": 30, **change}
    status = engine.status()
    assert {k: status[k] for k in change} == change
    assert status["reloads_total"] == reloads + 1
    thread.join(60)
    assert_complete(seen, 60)
    assert seen.chunks[-1]["model"] == change.get("model", "small")
    assert seen.chunks[0]["model"] == "small"


def conversation(turns: int, words: int = 10) -> list[dict[str, str]]:
    sentence = " ".join(["the quick brown fox jumps over the lazy dog"] * 4).split()[:words]
    messages = [{"role": "system", "content": "you are a demo model " + " ".join(sentence)}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i} " + " ".join(sentence)})
        messages.append({"role": "assistant", "content": f"answer {i} " + " ".join(sentence)})
    messages.append({"role": "user", "content": "last question " + " ".join(sentence)})
    return messages


def test_request_too_long_for_the_context_is_trimmed(engine: Engine) -> None:
    assert engine.config(n_ctx=256).status_code == 200
    r = engine.chat(**long_answer(16, conversation(6)))
    assert r.status_code == 200, r.text
    trimmed = r.json()["governor"]["trimmed_messages"]
    assert trimmed > 0
    assert trimmed % 2 == 0  # whole turns go
    assert r.json()["usage"]["prompt_tokens"] + 16 <= 256
    assert engine.log_events("engine.trimmed")[-1]["trimmed_messages"] == trimmed
    fits = engine.chat(**long_answer(16, conversation(0)))
    assert fits.json()["governor"]["trimmed_messages"] == 0


def test_last_message_that_cannot_fit_is_400(engine: Engine) -> None:
    assert engine.config(n_ctx=256).status_code == 200
    r = engine.chat(**long_answer(16, user("word " * 400)))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert engine.chat(**long_answer(4)).status_code == 200


def test_smaller_context_mid_stream_trims_and_continues(engine: Engine) -> None:
    assert engine.config(max_tokens_per_s=30).status_code == 200
    thread, seen = engine.stream_in_thread(long_answer(60, conversation(6)))
    eventually(lambda: arrived(seen, 5))
    r = engine.config(n_ctx=256)
    assert r.json()["applied"] == "reload"
    thread.join(60)
    assert_complete(seen, 60)
    assert seen.chunks[0].get("governor") is None
    trimmed = [c["governor"]["trimmed_messages"] for c in seen.chunks if "governor" in c]
    assert trimmed
    assert trimmed[-1] > 0
    assert engine.log_events("engine.trimmed")[-1]["when"] == "reconfig"


def long_prompt_on_medium(engine: Engine) -> dict[str, Any]:
    """A prompt whose evaluation takes seconds: medium tier, one thread, about 1600 tokens."""
    assert engine.config(model="medium").status_code == 200
    return {**long_answer(8, user("the quick brown fox " * 140)), "model": "medium"}


def test_cancel_during_a_long_prefill_stops_it(engine: Engine) -> None:
    body = long_prompt_on_medium(engine)
    before = engine.status()
    with engine.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the role chunk comes before the prompt is evaluated; then hang up
    eventually(lambda: engine.status()["generations_cancelled"] == before["generations_cancelled"] + 1)
    after = engine.status()
    assert after["busy"] is False
    assert after["tokens_generated_total"] == before["tokens_generated_total"]  # stopped before its first token


def test_the_reevaluation_after_a_reload_gives_way_to_a_newer_change(engine: Engine) -> None:
    body = long_prompt_on_medium(engine)
    assert engine.config(max_tokens_per_s=20).status_code == 200
    thread, seen = engine.stream_in_thread(body)
    eventually(lambda: arrived(seen, 2), timeout_s=120)
    # Another KV type: the conversation (about 1600 tokens) must be evaluated again in the new context.
    loads = engine.status()["loads_total"]
    assert engine.config(kv_type="q8_0").json()["applied"] == "reload"
    # The reload happens at the next token boundary: tokens decoded before it may still be on their way. Once the new
    # model is loaded they have all arrived, and the re-evaluation runs.
    eventually(lambda: engine.status()["loads_total"] > loads, timeout_s=120)
    n = len(seen.arrivals)
    r = engine.config(threads=2)  # arrives while that re-evaluation runs: it is stopped, the change applied
    answered = time.monotonic()
    assert r.json()["applied"] == "live"
    assert r.json()["tokens_waited"] == 0
    thread.join(120)
    assert_complete(seen, 8)
    assert seen.arrivals[n] > answered  # the change did not wait for the re-evaluation and the next token


def test_config_during_a_long_prefill_does_not_wait_for_it(engine: Engine) -> None:
    body = long_prompt_on_medium(engine)
    thread, seen = engine.stream_in_thread(body)
    eventually(lambda: len(seen.chunks) >= 1)  # the role chunk: the prompt is being evaluated now
    r = engine.config(threads=2)
    answered = time.monotonic()
    assert r.json()["applied"] == "live"
    thread.join(120)
    assert_complete(seen, 8)
    assert seen.arrivals[0] > answered  # applied before the first token, not after the prompt evaluation
