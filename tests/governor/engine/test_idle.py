"""Idle unload (--keep-alive), reload on the next request, and requests that arrive during a load."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.governor.engine.engine_proc import Engine, user
from tests.helpers import eventually

pytestmark = pytest.mark.slow

# The engine's imports and llama.cpp's backend, without a model: what an unloaded engine should come back to.
BARE_ENGINE = """
import psutil, uvicorn, llama_cpp
import governor.engine.app, governor.engine.serve
llama_cpp.llama_backend_init()
print(psutil.Process().memory_info().rss)
"""


@pytest.fixture(scope="module")
def engine(demo_ladder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = Engine(
        tmp_path_factory.mktemp("idle"), "--models", str(demo_ladder), "--tier", "large", "--threads", "1",
        "--keep-alive", "1", "--load-wait", "0",
    )  # fmt: skip
    yield eng
    assert eng.stop() == 0, eng.log()


def _unloaded(engine: Engine) -> bool:
    status = engine.status()
    return status["loaded"] is False and status["busy"] is False


def test_idle_engine_unloads_and_gives_the_memory_back(engine: Engine) -> None:
    assert engine.chat(messages=user("hello"), max_tokens=4).status_code == 200
    loaded = engine.status()
    assert loaded["loaded"] is True
    assert loaded["keep_alive_s"] == 1
    eventually(lambda: _unloaded(engine), timeout_s=30)
    unloaded = engine.status()
    assert unloaded["unloads_total"] >= 1
    assert unloaded["model"] == "large"  # the settings stay: the next load uses them
    bare = int(subprocess.run([sys.executable, "-c", BARE_ENGINE], capture_output=True, text=True, check=True).stdout)
    assert loaded["rss_bytes"] > 2 * bare
    assert unloaded["rss_bytes"] <= 1.1 * bare, (unloaded["rss_bytes"], bare)
    large = engine.http.get("/v1/models").json()["data"][0]
    assert (large["id"], large["loaded"], large["current"]) == ("large", False, True)


def test_next_request_reloads_and_is_served(engine: Engine) -> None:
    eventually(lambda: _unloaded(engine), timeout_s=30)
    loads = engine.status()["loads_total"]
    r = engine.chat(messages=user("are you there?"), max_tokens=4, ignore_eos=True)
    if r.status_code == 503:  # --load-wait 0: this request may be told to come back; the load goes on
        eventually(lambda: engine.status()["loaded"])
        r = engine.chat(messages=user("are you there?"), max_tokens=4, ignore_eos=True)
    else:
        assert float(r.headers["X-Governor-Load-S"]) > 0
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    status = engine.status()
    assert status["loaded"] is True
    assert status["loads_total"] == loads + 1
    assert engine.log_events("engine.model_loaded")[-1]["why"] == "idle"


def test_status_shows_the_load_under_way(engine: Engine) -> None:
    """A client that arrives during a load can see it in /engine/status (llama.cpp's progress callback)."""
    eventually(lambda: _unloaded(engine), timeout_s=30)
    loading: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: engine.chat(messages=user("wake up"), max_tokens=2), daemon=True)
    thread.start()

    def seen() -> bool:
        now = engine.status()["loading"]
        if now is not None:
            loading.append(now)
        return bool(loading) or (engine.status()["loaded"] and not thread.is_alive())

    eventually(seen, timeout_s=60, interval_s=0.005)
    thread.join(60)
    assert loading, "the load finished between two polls 5 ms apart"
    assert (loading[0]["model"], loading[0]["why"]) == ("large", "idle")
    assert all(0.0 <= entry["progress"] <= 1.0 for entry in loading)
    assert all(entry["elapsed_s"] >= 0 for entry in loading)
    eventually(lambda: engine.status()["loaded"])
    assert engine.status()["loading"] is None


def test_config_while_unloaded_is_kept_for_the_next_load(engine: Engine) -> None:
    eventually(lambda: _unloaded(engine), timeout_s=30)
    r = engine.config(n_ctx=512, threads=1)
    assert r.status_code == 200, r.text
    assert r.json()["applied"] == "unloaded"
    assert engine.status()["loaded"] is False
    assert engine.chat(messages=user("hi"), max_tokens=2).status_code in (200, 503)
    eventually(lambda: engine.status()["loaded"])
    assert engine.status()["n_ctx"] == 512


def test_requests_during_a_load_get_503_with_retry_after(engine: Engine) -> None:
    """--load-wait 0: a request that finds a load under way is told when to come back, from the load's progress."""
    seen: list[httpx.Response] = []
    for _ in range(5):  # a burst right after an unload: the first starts the load, others arrive during it
        eventually(lambda: _unloaded(engine), timeout_s=30)
        burst: list[httpx.Response] = []

        def ask(into: list[httpx.Response] = burst) -> None:
            into.append(engine.chat(messages=user("q"), max_tokens=2))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        seen += burst
        if any(r.status_code == 503 for r in burst):
            break
    refused = [r for r in seen if r.status_code == 503]
    assert refused, [r.status_code for r in seen]
    for r in refused:
        assert r.json()["error"]["code"] == "model_loading"
        assert 1 <= int(r.headers["Retry-After"]) <= 300
        assert 0.0 <= float(r.headers["X-Governor-Load-Progress"]) <= 1.0
    assert {r.status_code for r in seen} <= {200, 503}
    eventually(lambda: engine.status()["loaded"])
    assert engine.chat(messages=user("now?"), max_tokens=2).status_code == 200
