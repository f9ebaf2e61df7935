"""Long chats on the real model (SmolLM2-135M-Instruct) in real engine processes: each turn evaluates only its new
tokens (prefix reuse, also across clients that share a system prompt); a chat that outgrows the context loses old
turns in one large chunk whose kept part is moved in the KV cache (context shift), or re-evaluated once where
shifting is not used; `--context-shift off` keeps the old behaviour (every turn re-evaluated). Counted in tokens the
engine evaluated (`governor.prompt_tokens_evaluated`, `/engine/status`), never in time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.governor.engine.engine_proc import Engine

pytestmark = pytest.mark.slow

SYSTEM = "You are Captain Byte, a cheerful assistant on a sailing ship. " + "Keep the ship's log tidy and short. " * 6
N_CTX = 512


def question(i: int) -> str:
    return f"Question {i}: tell me one fact about the tides near harbour {i}, and why sailors should care about it."


def answer(i: int) -> str:
    return f"Answer {i}: the tide near harbour {i} turns twice a day, so plan the crossing with the current."


class Chat:
    """A client's chat: the whole history goes with every turn, as OpenAI clients send it."""

    def __init__(self, engine: Engine, system: str = SYSTEM) -> None:
        self.engine = engine
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.turns: list[dict[str, Any]] = []  # each response's usage + governor

    def turn(self, i: int) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": question(i)})
        r = self.engine.chat(messages=self.messages, temperature=0, max_tokens=4)
        assert r.status_code == 200, r.text
        body = r.json()
        self.messages.append({"role": "assistant", "content": answer(i)})
        got = {**body["usage"], **body["governor"]}
        self.turns.append(got)
        return got


def start(tmp: Path, ladder: Path, mode: str) -> Engine:
    return Engine(
        tmp, "--models", str(ladder), "--tier", "medium", "--threads", "1", "--ctx", str(N_CTX), "--context-shift", mode
    )


@pytest.fixture(scope="module")
def shifting(real_ladder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = start(tmp_path_factory.mktemp("shift"), real_ladder, "on")
    yield eng
    assert eng.stop() == 0, eng.log()


def new_tokens(chat: Chat, k: int) -> int:
    """Prompt tokens of turn k that were not in turn k-1's prompt (the last answer, the new question, the template).
    Turn k-1's own answer was generated, not sent: it is in the cache only as far as its tokens match ours."""
    return int(chat.turns[k]["prompt_tokens"] - chat.turns[k - 1]["prompt_tokens"])


def test_each_turn_evaluates_only_its_new_tokens(shifting: Engine) -> None:
    chat = Chat(shifting)
    before = shifting.status()["prompt_tokens_evaluated_total"]
    for i in range(4):
        chat.turn(i)
    for k in range(1, 4):
        got = chat.turns[k]
        assert got["trimmed_messages"] == 0
        assert got["prompt_tokens_evaluated"] <= new_tokens(chat, k) + 2, chat.turns
        assert got["prompt_tokens_evaluated"] < got["prompt_tokens"] / 2, chat.turns
    total = sum(t["prompt_tokens_evaluated"] for t in chat.turns)
    assert shifting.status()["prompt_tokens_evaluated_total"] - before == total


def test_clients_sharing_a_system_prompt_reuse_it(shifting: Engine) -> None:
    a, b = Chat(shifting), Chat(shifting)
    a.turn(100)
    b.turn(200)  # another conversation with the same system prompt (about 70 tokens): only what follows is evaluated
    assert b.turns[0]["prompt_tokens_evaluated"] < b.turns[0]["prompt_tokens"] / 2, (a.turns, b.turns)
    other = Chat(shifting, system="You are a terse assistant.")
    other.turn(300)  # a different system prompt: everything is new
    assert other.turns[0]["prompt_tokens_evaluated"] >= other.turns[0]["prompt_tokens"] - 8


def outgrow(chat: Chat, extra_turns: int) -> int:
    """Turns until old turns are dropped, then `extra_turns` more; the index of the turn that dropped them."""
    i = 0
    while not chat.turns or chat.turns[-1]["trimmed_messages"] == 0:
        chat.turn(i)
        i += 1
        assert i < 30, chat.turns
    cut = i - 1
    for _ in range(extra_turns):
        chat.turn(i)
        i += 1
    return cut


def test_a_chat_that_outgrows_the_context_shifts_the_cache(shifting: Engine) -> None:
    before = shifting.status()
    chat = Chat(shifting)
    cut = outgrow(chat, 2)
    at = chat.turns[cut]
    assert at["context"] == "shift"
    assert at["shifted_tokens"] > 0
    # The kept turns moved in the cache: only the new turn was evaluated (as many tokens as a turn adds), not the
    # kept part.
    assert at["prompt_tokens_evaluated"] <= new_tokens(chat, cut - 1) + 2, chat.turns
    # A large chunk went (about half of what could), not just enough for this turn.
    assert at["prompt_tokens"] <= (N_CTX - 4) * 0.7, chat.turns
    for k in range(cut + 1, len(chat.turns)):  # the same cut: the prompt's beginning stays, so the cache is reused
        later = chat.turns[k]
        assert later["trimmed_messages"] == at["trimmed_messages"]
        assert later["shifted_tokens"] == 0
        assert later["prompt_tokens_evaluated"] <= new_tokens(chat, k) + 2, chat.turns
    after = shifting.status()
    assert after["context_shifts_total"] == before["context_shifts_total"] + 1
    assert after["context_shift"] == "on"
    trimmed = shifting.log_events("engine.trimmed")[-1]
    assert trimmed["context"] == "shift"
    # Still the real model answering, about the kept conversation.
    r = shifting.chat(messages=[*chat.messages, {"role": "user", "content": "What is the capital of France?"}])
    assert r.status_code == 200, r.text


def test_without_shifting_the_kept_part_is_evaluated_once_then_reused(real_ladder: Path, tmp_path: Path) -> None:
    eng = start(tmp_path, real_ladder, "reevaluate")
    try:
        chat = Chat(eng)
        cut = outgrow(chat, 2)
        at = chat.turns[cut]
        assert at["context"] == "reevaluate"  # said in the response (and the log): no shift
        assert at["shifted_tokens"] == 0
        assert at["prompt_tokens_evaluated"] >= at["prompt_tokens"] * 0.6, chat.turns  # all after the system prompt
        assert eng.log_events("engine.trimmed")[-1]["context"] == "reevaluate"
        for k in range(cut + 1, len(chat.turns)):
            later = chat.turns[k]
            assert later["trimmed_messages"] == at["trimmed_messages"]
            assert later["prompt_tokens_evaluated"] <= new_tokens(chat, k) + 2, chat.turns
    finally:
        assert eng.stop() == 0, eng.log()


def test_context_shift_off_reevaluates_every_turn(real_ladder: Path, tmp_path: Path) -> None:
    eng = start(tmp_path, real_ladder, "off")
    try:
        chat = Chat(eng)
        cut = outgrow(chat, 2)
        for got in chat.turns[cut:]:  # as few turns dropped as possible: each turn changes the prompt's beginning
            assert got["context"] == "trim"
            assert got["prompt_tokens"] > (N_CTX - 4) * 0.7, chat.turns
            assert got["prompt_tokens_evaluated"] >= got["prompt_tokens"] * 0.6, chat.turns
        assert chat.turns[-1]["trimmed_messages"] > chat.turns[cut]["trimmed_messages"]
    finally:
        assert eng.stop() == 0, eng.log()


def test_a_cache_that_cannot_shift_falls_back_and_says_so(demo_ladder: Path, tmp_path: Path) -> None:
    """The random demo model's q8_0 cache (head_dim 32) is one llama.cpp crashes moving: the engine does not
    shift it, re-evaluates the kept part once, says so, and goes on serving."""
    eng = Engine(tmp_path, "--models", str(demo_ladder), "--tier", "small", "--threads", "1", "--ctx", str(N_CTX))
    try:
        chat = Chat(eng)
        cut = outgrow(chat, 1)
        at = chat.turns[cut]
        assert at["context"] == "reevaluate"
        assert at["shifted_tokens"] == 0
        # More than the new turn: the kept part after the system prompt was evaluated again.
        assert at["prompt_tokens_evaluated"] >= new_tokens(chat, cut - 1) + 20, chat.turns
        assert eng.log_events("engine.trimmed")[-1]["context"] == "reevaluate"
        assert eng.status()["context_shifts_total"] == 0
    finally:
        assert eng.stop() == 0, eng.log()


def test_a_context_change_copies_the_cache_a_kv_change_cannot(shifting: Engine) -> None:
    chat = Chat(shifting)
    for i in range(2):
        chat.turn(500 + i)
    before = shifting.status()
    try:
        assert shifting.config(n_ctx=1024).json()["applied"] == "reload"
        copied = shifting.log_events("engine.cache_copied")[-1]
        assert copied["tokens"] >= chat.turns[-1]["prompt_tokens"]
        assert shifting.status()["cache_copies_total"] == before["cache_copies_total"] + 1
        got = chat.turn(502)  # the new context holds the conversation: only the new turn is evaluated
        assert got["prompt_tokens_evaluated"] <= new_tokens(chat, 2) + 2, chat.turns

        assert shifting.config(kv_type="q8_0").json()["applied"] == "reload"  # another cache layout: no copy
        assert shifting.status()["cache_copies_total"] == before["cache_copies_total"] + 1
        got = chat.turn(503)
        assert got["prompt_tokens_evaluated"] >= got["prompt_tokens"] - 4, chat.turns
    finally:
        assert shifting.config(n_ctx=N_CTX, kv_type="f16").status_code == 200
