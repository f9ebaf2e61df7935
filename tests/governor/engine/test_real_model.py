"""The real demo model (SmolLM2-135M-Instruct tiers) in a real engine process: its own chat template, answers that
stop at the end of the turn, a factual answer at temperature 0, and an answer that goes on as the same readable answer
across a mid-answer change of threads, context, KV type and tier. llama.cpp runs only in child processes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from governor.engine.chat import fit
from governor.engine.config import models_from_ladder
from policies.decision import EngineConfig
from policies.ladder import load_ladder
from tests.governor.engine.engine_proc import Chunked, Engine, at_baseline, ladder_engine, user
from tests.helpers import eventually
from tests.native import in_child

pytestmark = pytest.mark.slow

PARIS = "What is the capital of France? Answer in one sentence."
STORY = "Write a short story about a lighthouse keeper and a storm."
# One thread: on a shared 2-core machine two llama.cpp threads can be much slower than one.
BASELINE: dict[str, Any] = {"model": "medium", "n_ctx": 2048, "kv_type": "f16", "threads": 1, "max_tokens_per_s": None}


@pytest.fixture(scope="module")
def module_engine(real_ladder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with ladder_engine(tmp_path_factory.mktemp("real"), real_ladder, "medium") as eng:
        yield eng


@pytest.fixture
def engine(module_engine: Engine) -> Iterator[Engine]:
    """The module's engine, back at the baseline settings before and after each test."""
    with at_baseline(module_engine, BASELINE) as eng:
        yield eng


def greedy(text: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": user(text), "temperature": 0, "max_tokens": max_tokens}  # no "model": the current tier


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z']+|[^\sA-Za-z']+", text)


def assert_readable_english(text: str) -> None:
    """Words, not bytes or markup: no U+FFFD, no chat-template tokens, and nearly every word made of letters."""
    assert "\ufffd" not in text, text
    assert "<|" not in text, text
    tokens = text.split()
    assert len(tokens) >= 5, text
    wordlike = [t for t in tokens if re.fullmatch(r"[\"'(]*[A-Za-z][A-Za-z'-]*[.,;:!?\"')]*", t)]
    assert len(wordlike) >= 0.9 * len(tokens), text


def test_the_ggufs_chat_template_is_applied_and_the_answer_stops_at_the_end_of_turn(engine: Engine) -> None:
    r = engine.chat(**greedy(PARIS, 64))

    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "medium"  # no "model" in the request: the engine's current tier answered
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 64  # ended by <|im_end|>, not by max_tokens
    assert_readable_english(body["choices"][0]["message"]["content"])


def test_temperature_0_knows_the_capital_of_france(engine: Engine) -> None:
    body = engine.chat(**greedy(PARIS, 64)).json()
    assert "Paris" in body["choices"][0]["message"]["content"]


@pytest.mark.parametrize("tier", ["large", "medium", "small"])
def test_every_tier_answers_coherently(engine: Engine, tier: str) -> None:
    assert engine.config(model=tier).status_code == 200
    body = engine.chat(**greedy(PARIS, 64)).json()
    answer = body["choices"][0]["message"]["content"]
    assert body["model"] == tier
    assert "Paris" in answer
    assert_readable_english(answer)


def rendered_prompt(ladder: str, messages: list[dict[str, str]], n_ctx: int) -> tuple[str, int]:
    """In the child: the prompt the engine would send for `messages` in `n_ctx` tokens, as text, and how many
    messages were trimmed."""
    from governor.engine.model import LoadedModel

    models = models_from_ladder(load_ladder(Path(ladder)))
    model = LoadedModel(
        models["medium"], EngineConfig(model="medium", n_ctx=n_ctx, kv_type="f16", threads=1, max_tokens_per_s=None)
    )
    try:
        fitted = fit(model, messages, n_ctx, answer_room=64)
        text = model.llm.detokenize(fitted.tokens, special=True).decode()
        return text, fitted.trimmed_messages
    finally:
        model.close()


def long_chat(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are Captain Byte, a cheerful assistant on a sailing ship."}]
    for i in range(turns):
        msgs += [
            {"role": "user", "content": f"Tell me fact number {i} about the ocean, in detail please."},
            {"role": "assistant", "content": "The ocean covers most of the planet and is very deep. " * 4},
        ]
    return [*msgs, {"role": "user", "content": PARIS}]


def test_the_prompt_uses_the_models_template_and_trimming_keeps_the_system_message(real_ladder: Path) -> None:
    short, trimmed = in_child(rendered_prompt, str(real_ladder), user("hi"), 2048)
    assert trimmed == 0
    # SmolLM2's own template (from the GGUF), which adds its default system message; ChatML would not.
    assert short.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert short.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    prompt, trimmed = in_child(rendered_prompt, str(real_ladder), long_chat(12), 256)
    assert trimmed > 0
    assert prompt.startswith("<|im_start|>system\nYou are Captain Byte")  # ours, kept; not the template's default
    assert "SmolLM" not in prompt
    assert prompt.endswith(f"{PARIS}<|im_end|>\n<|im_start|>assistant\n")


def test_a_trimmed_long_chat_still_gets_a_real_answer(engine: Engine) -> None:
    assert engine.config(n_ctx=256).status_code == 200
    body = engine.chat(messages=long_chat(12), temperature=0, max_tokens=48).json()
    assert body["governor"]["trimmed_messages"] > 0
    assert "Paris" in body["choices"][0]["message"]["content"]


def story_with_a_change(
    engine: Engine, change: dict[str, Any], *, max_tokens: int = 110, after_chunks: int = 20
) -> tuple[str, str]:
    """Stream the story (rate-capped, so the change lands mid-answer); apply `change` after `after_chunks` content
    chunks. Returns (the text the client had before the change was sent, the whole answer)."""
    assert engine.config(max_tokens_per_s=25).status_code == 200
    thread, seen = engine.stream_in_thread(greedy(STORY, max_tokens))
    eventually(lambda: len(seen.arrivals) >= after_chunks, timeout_s=60)
    before = Chunked(chunks=list(seen.chunks)).text
    r = engine.config(**change)
    assert r.status_code == 200, r.text
    thread.join(200)
    assert seen.done, seen.chunks[-1:]
    assert not [c for c in seen.chunks if "error" in c]
    assert seen.finish_reason in ("stop", "length")
    return before, seen.text


def assert_seamless(before: str, whole: str, reference: str) -> None:
    """The answer goes on from where it was: the part before the change is the unchanged answer's beginning, and the
    continuation neither repeats the last words before the seam nor garbles."""
    assert reference.startswith(before), (before, reference)
    assert whole.startswith(before)
    after = whole[len(before) :]
    assert_readable_english(after)
    tail = words(before)[-3:]
    head = words(after)[:15]
    repeats = [i for i in range(len(head) - 2) if head[i : i + 3] == tail]
    assert not repeats, f"the words before the change, {tail}, repeat after it: {after[:120]!r}"


@pytest.fixture(scope="module")
def reference_story(module_engine: Engine) -> str:
    assert module_engine.config(**BASELINE).status_code == 200
    body = module_engine.chat(**greedy(STORY, 110)).json()
    text: str = body["choices"][0]["message"]["content"]
    assert_readable_english(text)
    assert len(words(text)) > 40, text  # long enough to change mid-answer
    return text


def test_a_threads_change_mid_answer_gives_exactly_the_same_answer(engine: Engine, reference_story: str) -> None:
    # Shorter: on a busy 2-core machine two llama.cpp threads can be ten times slower than one.
    before, whole = story_with_a_change(engine, {"threads": 2}, max_tokens=50)
    assert before
    assert len(whole) > len(before)
    assert reference_story.startswith(whole)  # greedy: the same tokens, as far as this shorter answer goes


@pytest.mark.parametrize(
    "change",
    [{"n_ctx": 1024}, {"kv_type": "q8_0"}, {"model": "small"}, {"model": "large"}],
    ids=["n_ctx", "kv_type", "tier-down", "tier-up"],
)
def test_a_reload_mid_answer_continues_the_same_answer(
    engine: Engine, reference_story: str, change: dict[str, Any]
) -> None:
    before, whole = story_with_a_change(engine, change)
    assert_seamless(before, whole, reference_story)
    assert engine.status()[next(iter(change))] == next(iter(change.values()))


def test_a_kv_type_change_mid_answer_is_built_warm_while_the_answer_goes_on(
    engine: Engine, reference_story: str
) -> None:
    # Two threads: the new cache is built with one while the answer goes on with the other (governor.engine.swap).
    assert engine.config(threads=2).status_code == 200
    warm_before = engine.status()["warm_swaps_total"]
    before, whole = story_with_a_change(engine, {"kv_type": "q8_0"}, after_chunks=8)
    status = engine.status()
    assert status["warm_swaps_total"] == warm_before + 1
    assert status["kv_type"] == "q8_0"
    assert status["threads"] == 2  # both halves back on the new context
    applied = engine.log_events("engine.config")[-1]
    assert applied["warm"] is True
    assert_seamless(before, whole, reference_story)


def test_while_a_warm_swap_builds_the_answer_keeps_coming(engine: Engine) -> None:
    assert engine.config(threads=2, max_tokens_per_s=25).status_code == 200
    thread, seen = engine.stream_in_thread(greedy(STORY, 110))
    eventually(lambda: len(seen.arrivals) >= 5, timeout_s=60)
    r = engine.config(kv_type="q8_0")
    thread.join(200)
    assert r.status_code == 200, r.text
    # Cold, the answer stops until the change is applied: at most the token in flight comes meanwhile.
    assert r.json()["tokens_waited"] > 1, r.json()
    assert seen.done
