"""Pausing a real engine (SmolLM2) for a memory squeeze (issue 11 point 5): POST /engine/pause unloads the model at
the next token boundary while the answer's stream stays open with nothing sent, requests arriving meanwhile wait in
the queue, and on resume the same answer goes on (its context evaluated again) as if nothing had happened."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.governor.engine.engine_proc import Chunked, Engine
from tests.governor.engine.test_real_model import PARIS, STORY, assert_seamless, greedy
from tests.helpers import eventually

pytestmark = pytest.mark.slow

WAIT = "no tier fits in 120 MiB; waiting for memory"
MIB = 1 << 20
BASELINE: dict[str, Any] = {"model": "medium", "n_ctx": 2048, "kv_type": "f16", "threads": 1, "max_tokens_per_s": None}


@pytest.fixture(scope="module")
def module_engine(real_ladder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = Engine(tmp_path_factory.mktemp("pause"), "--models", str(real_ladder), "--tier", "medium", "--threads", "1")
    yield eng
    assert eng.stop() == 0, eng.log()


@pytest.fixture
def engine(module_engine: Engine) -> Iterator[Engine]:
    assert module_engine.config(**BASELINE).status_code == 200
    yield module_engine
    pause(module_engine, None)
    assert module_engine.config(**BASELINE).status_code == 200


def pause(engine: Engine, reason: str | None) -> dict[str, Any]:
    r = engine.http.post("/engine/pause", json={"reason": reason})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["paused"] == reason
    return body


def unloaded(engine: Engine) -> dict[str, Any]:
    status = engine.status()
    assert not status["loaded"], status
    return status


def test_a_paused_answer_gives_its_memory_back_and_goes_on_when_resumed(engine: Engine) -> None:
    reference = engine.chat(**greedy(STORY, 110)).json()["choices"][0]["message"]["content"]
    loaded = engine.status()
    assert engine.config(max_tokens_per_s=25).status_code == 200  # so that the pause lands mid-answer
    thread, seen = engine.stream_in_thread(greedy(STORY, 110))
    eventually(lambda: len(seen.arrivals) >= 20, timeout_s=60)

    pause(engine, WAIT)
    status = eventually(lambda: unloaded(engine), timeout_s=30)
    held, before = len(seen.chunks), Chunked(chunks=list(seen.chunks)).text
    assert status["paused"] == WAIT
    assert status["busy"] is True  # the answer is still the engine's
    assert status["rss_bytes"] < loaded["rss_bytes"] - 50 * MIB, (loaded["rss_bytes"], status["rss_bytes"])
    assert status["unloads_total"] == loaded["unloads_total"] + 1

    # Meanwhile: a new request waits in the queue, and a change applies to the next load.
    other, queued = engine.stream_in_thread(greedy(PARIS, 24))
    eventually(lambda: engine.status()["queue_length"] == 1)
    changed = engine.config(n_ctx=1024)
    assert changed.status_code == 200, changed.text
    assert changed.json()["applied"] == "unloaded"
    assert len(seen.chunks) == held  # nothing was sent while paused (and the stream is still open)
    assert not seen.done
    assert not queued.chunks
    assert not engine.status()["loaded"]

    pause(engine, None)
    thread.join(200)
    other.join(200)
    assert seen.done, seen.chunks[-1:]
    assert not [c for c in seen.chunks if "error" in c]
    assert seen.finish_reason in ("stop", "length")
    assert_seamless(before, seen.text, reference)
    assert "Paris" in queued.text
    status = engine.status()
    assert (status["paused"], status["loaded"], status["n_ctx"]) == (None, True, 1024)
    assert status["loads_total"] == loaded["loads_total"] + 1
    assert status["generations_failed"] == loaded["generations_failed"]


def test_a_paused_answer_whose_client_leaves_ends_and_an_idle_paused_engine_waits(engine: Engine) -> None:
    before = engine.status()
    assert engine.config(max_tokens_per_s=25).status_code == 200
    with engine.http.stream("POST", "/v1/chat/completions", json=greedy(STORY, 110) | {"stream": True}) as r:
        assert r.status_code == 200
        content = 0
        for line in r.iter_lines():
            content += '"content"' in line
            if content >= 5:
                break
        pause(engine, WAIT)
        eventually(lambda: unloaded(engine), timeout_s=30)
    # The client left while its answer was paused: the engine is idle, still paused, nothing loaded.
    eventually(lambda: not engine.status()["busy"], timeout_s=30)
    status = engine.status()
    assert status["generations_cancelled"] == before["generations_cancelled"] + 1
    assert (status["paused"], status["loaded"]) == (WAIT, False)

    # An idle paused engine keeps a new request in its queue until the resume, then loads and answers it.
    thread, waiting = engine.stream_in_thread(greedy(PARIS, 24))
    eventually(lambda: engine.status()["queue_length"] == 1)
    assert not waiting.chunks
    assert not engine.status()["loaded"]
    pause(engine, None)
    thread.join(200)
    assert waiting.done
    assert "Paris" in waiting.text
    assert engine.status()["generations_failed"] == before["generations_failed"]


def test_a_pause_during_a_kv_change_keeps_the_change_and_the_answer(engine: Engine) -> None:
    """Two threads let a q8_0 change mid-answer be built warm beside the answer (governor.engine.swap): a pause that
    comes meanwhile cancels that second context too (memory is short) and the change applies to the next load, or the
    switch came first; either way the answer goes on in the new cache after the resume."""
    assert engine.config(threads=2, max_tokens_per_s=25).status_code == 200
    thread, seen = engine.stream_in_thread(greedy(STORY, 110))
    eventually(lambda: len(seen.arrivals) >= 10, timeout_s=60)
    answers: list[Any] = []
    change = threading.Thread(target=lambda: answers.append(engine.config(kv_type="q8_0")))
    change.start()
    pause(engine, WAIT)
    change.join(120)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["applied"] in ("reload", "unloaded")
    status = eventually(lambda: unloaded(engine), timeout_s=30)
    assert status["kv_type"] == "q8_0"
    held = len(seen.chunks)
    pause(engine, None)
    thread.join(200)
    assert seen.done, seen.chunks[-1:]
    assert len(seen.chunks) > held
    assert not [c for c in seen.chunks if "error" in c]
    status = engine.status()
    assert (status["loaded"], status["kv_type"]) == (True, "q8_0")


@pytest.mark.parametrize(
    ("body", "param"),
    [({"reason": 5}, "reason"), ({"reason": None, "why": "memory"}, "why"), ({"reason": ""}, "reason"), ({}, "reason")],
)
def test_a_bad_pause_body_is_refused_and_changes_nothing(engine: Engine, body: dict[str, Any], param: str) -> None:
    r = engine.http.post("/engine/pause", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    status = engine.status()
    assert status["paused"] is None
