"""EngineClient against a real `governor engine` process on the demo models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from governor.daemon.driver import EngineDriver
from governor.daemon.llamacpp import LlamaCppPython
from governor.engine.client import EngineClient, EngineError
from policies.decision import EngineConfig
from tests.governor.engine.engine_proc import Engine, ladder_with_noflash

pytestmark = pytest.mark.slow


@pytest.fixture
def engine(demo_ladder: Path, tmp_path: Path) -> Iterator[Engine]:
    eng = Engine(tmp_path, "--models", str(ladder_with_noflash(demo_ladder, tmp_path)), "--threads", "2")
    try:
        yield eng
    finally:
        eng.stop()


def test_client_reads_and_changes_a_real_engine(engine: Engine) -> None:
    with EngineClient(engine.socket) as client:
        ready = client.wait_ready(30, process=engine.proc)
        assert (ready.model, ready.n_ctx, ready.kv_type, ready.threads) == ("large", 2048, "f16", 2)
        assert ready.rss_bytes is not None
        assert ready.rss_bytes > 50 << 20
        assert client.models() == ["large", "medium", "small", "noflash"]

        live = client.configure(threads=1, max_tokens_per_s=50.0)
        assert (live.applied, live.config.threads, live.config.max_tokens_per_s) == ("live", 1, 50.0)

        reload = client.configure(model="small", kv_type="q8_0", n_ctx=1024)
        assert reload.applied == "reload"
        assert (reload.config.model, reload.config.kv_type, reload.config.n_ctx) == ("small", "q8_0", 1024)
        assert reload.seconds > 0

        status = client.status()
        assert (status.model, status.kv_type, status.threads, status.max_tokens_per_s) == ("small", "q8_0", 1, 50.0)


def test_the_daemons_driver_applies_and_observes_through_the_client(engine: Engine) -> None:
    driver: EngineDriver = LlamaCppPython(Path("ladder.toml"), engine.socket)  # its client, as the daemon uses it
    try:
        driver.apply(EngineConfig(threads=1, n_ctx=1024, kv_type="q4_0", model="medium", max_tokens_per_s=None))
        observed = driver.observe()
    finally:
        driver.close()

    assert observed is not None
    assert (observed.model, observed.busy) == ("medium", False)
    assert observed.rss_bytes is not None
    status = engine.status()
    assert (status["threads"], status["n_ctx"], status["kv_type"], status["max_tokens_per_s"]) == (
        1,
        1024,
        "q4_0",
        None,
    )


def test_refusals_are_one_line_errors_and_the_engine_keeps_serving(engine: Engine) -> None:
    with EngineClient(engine.socket) as client:
        with pytest.raises(EngineError) as unknown:
            client.configure(model="huge")
        with pytest.raises(EngineError) as impossible:
            client.configure(model="noflash", kv_type="q8_0")

        assert (unknown.value.status, unknown.value.param) == (404, "model")
        assert str(unknown.value).startswith(f"engine at {engine.socket}: HTTP 404: ")
        assert "huge" in str(unknown.value)
        assert impossible.value.status == 400
        assert "flash" in impossible.value.reason
        assert "\n" not in str(unknown.value) + str(impossible.value)
        assert client.status().model == "large"
        answer = client.chat([{"role": "user", "content": "hello"}], model="large", max_tokens=4)
        assert answer["usage"]["completion_tokens"] == 4


def test_stream_chat_streams_a_real_answer(engine: Engine) -> None:
    with EngineClient(engine.socket) as client:
        chunks = list(
            client.stream_chat(
                [{"role": "user", "content": "hello"}], model="large", max_tokens=8, ignore_eos=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip

    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
