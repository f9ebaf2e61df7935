"""Memory after a model swap, and a clean SIGTERM, on real engine processes."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import httpx
import psutil
import pytest

from tests.governor.engine.engine_proc import Engine, user
from tests.helpers import eventually

pytestmark = pytest.mark.slow


def warm(engine: Engine, model: str) -> int:
    """Answer once (touching the weights and the KV cache), then read the RSS."""
    r = engine.chat(model=model, messages=user("warm up"), max_tokens=16, ignore_eos=True)
    assert r.status_code == 200, r.text
    rss: int = engine.status()["rss_bytes"]
    return rss


def test_memory_is_returned_after_large_to_small(demo_ladder: Path, tmp_path: Path) -> None:
    (tmp_path / "swap").mkdir()
    (tmp_path / "cold").mkdir()
    swapped = Engine(tmp_path / "swap", "--models", str(demo_ladder), "--tier", "large", "--threads", "1")
    try:
        rss_large = warm(swapped, "large")
        r = swapped.config(model="small")
        assert r.json()["applied"] == "reload"
        rss_after = warm(swapped, "small")
    finally:
        assert swapped.stop() == 0
    cold = Engine(tmp_path / "cold", "--models", str(demo_ladder), "--tier", "small", "--threads", "1")
    try:
        rss_cold = warm(cold, "small")
    finally:
        assert cold.stop() == 0
    assert rss_after < rss_large
    assert rss_after <= 1.3 * rss_cold, (rss_large, rss_after, rss_cold)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_single_model_on_socket_and_loopback_port_then_sigterm(demo_ladder: Path, tmp_path: Path) -> None:
    port = free_port()
    model = demo_ladder.parent / "demo-small.gguf"
    engine = Engine(
        tmp_path, "--model", str(model), "--threads", "1", "--socket-mode", "0660", "--port", str(port),
        "--max-tokens-per-s", "20", "--drain-s", "1",
    )  # fmt: skip
    assert stat.S_IMODE(engine.socket.stat().st_mode) == 0o660
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as tcp:
        assert tcp.get("/engine/status").json()["model"] == "demo-small"
        assert [m["id"] for m in tcp.get("/v1/models").json()["data"]] == ["demo-small"]
    listening = [c.laddr for c in psutil.Process(engine.proc.pid).net_connections("tcp") if c.status == "LISTEN"]
    assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", port)]

    thread, seen = engine.stream_in_thread(
        {"model": "demo-small", "messages": user("long"), "max_tokens": 2000, "ignore_eos": True}
    )
    eventually(lambda: len(seen.arrivals) >= 3)
    assert engine.stop() == 0, engine.log()
    thread.join(30)
    assert seen.done  # the answer ended at a token boundary with its final chunk, not a broken connection
    assert seen.finish_reason == "length"
    assert not engine.socket.exists()
    assert engine.log_events("engine.stopped")
