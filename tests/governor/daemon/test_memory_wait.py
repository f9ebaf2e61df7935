"""A memory squeeze where nothing fits: the real daemon does not start its engine into the OOM killer, says why,
holds requests, and starts the engine by itself once /proc/meminfo (of the fake root) shows memory again."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.governor.daemon.daemon_proc import TEST_POLICY, DaemonProc, device_tree
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "hello"}]
WAITING = re.compile(r"no tier fits in (\d+) MiB; waiting for memory")


def squeezed(root: Path) -> FakeTree:
    tree = device_tree(root)
    # 127 MiB: above the policy's critical floor (100 MiB), but even the smallest tier's own memory (its KV cache and
    # buffers, what the OOM killer counts) and the 100 MiB kill margin do not fit: a start would meet the killer. (At
    # 293 MiB no tier fits the 256 MiB reserve either, but the smallest now runs below its footprint: issue 27.)
    tree.meminfo(total_kb=16_000_000, available_kb=130_000)
    return tree


def test_nothing_fits_means_no_engine_a_reason_and_a_start_once_memory_is_back(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path
) -> None:
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, config="request_hold_s = 0.5\n", tree=squeezed)
    try:

        def waiting() -> dict[str, Any]:
            d.check_alive()
            assert d.control.exists(), "no control socket yet"
            status = d.status()
            assert status["supervisor"]["waiting"], status["supervisor"]
            assert status["reason"], "no decision recorded yet"
            return status

        status = eventually(waiting, timeout_s=60)
        said = status["supervisor"]["waiting"]
        assert WAITING.fullmatch(said), said
        assert int(WAITING.fullmatch(said).group(1)) <= 40  # type: ignore[union-attr]
        assert said in status["reason"]  # `governor why` says it too
        ticks = status["ticks"]
        eventually(lambda: d.status()["ticks"] >= ticks + 4, timeout_s=30)  # several decisions later ...
        assert d.status()["supervisor"]["starts"] == 0  # ... still no start into the wall

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.engine_socket)), timeout=30) as client:
            held = client.post(
                "http://engine/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
        assert held.status_code == 503
        assert said in held.json()["error"]["message"]
        assert d.status()["supervisor"]["starts"] == 0

        d.tree.meminfo(total_kb=16_000_000, available_kb=12_000_000)
        back = d.wait_ready(timeout_s=120)
        assert back["supervisor"]["waiting"] is None
        assert back["supervisor"]["starts"] == 1
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.engine_socket)), timeout=60) as client:
            answer = client.post(
                "http://engine/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
        assert answer.status_code == 200
    finally:
        d.stop()


def roomy(root: Path) -> FakeTree:
    tree = device_tree(root)
    tree.meminfo(total_kb=16_000_000, available_kb=12_000_000)
    return tree


def test_an_answer_in_flight_is_paused_without_its_model_and_goes_on_when_memory_is_back(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path
) -> None:
    """Memory runs out mid-answer: the engine unloads its model at the next token (the process and the client's stream
    stay, nothing is sent, status says why) instead of finishing the answer into the OOM killer; when memory is
    back the same engine loads again and the same stream goes on to its last token."""
    policy = TEST_POLICY + "[memory]\nreserve_mb = 1024.0\n"  # with no memory available even the engine's RSS is short
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, policy=policy, config="request_hold_s = 0.5\n", tree=roomy)
    try:
        d.wait_ready()
        pid = d.status()["supervisor"]["pid"]
        with d.client.hold(max_tokens_per_s=4.0):  # 200 tokens at 4 tok/s: a 50 s answer
            eventually(lambda: d.engine.status().max_tokens_per_s == 4.0, timeout_s=30)
            chunks = d.engine.stream_chat(
                HELLO, model="large", max_tokens=200, ignore_eos=True, stream_options={"include_usage": True}
            )
            got = [next(chunks) for _ in range(3)]
            d.tree.meminfo(total_kb=16_000_000, available_kb=0)

            def paused() -> dict[str, Any]:
                status = d.status()
                assert status["supervisor"]["waiting"], status["supervisor"]
                assert status["engine"], status
                assert status["engine"]["loaded"] is False, status["engine"]
                return status

            status = eventually(paused, timeout_s=60)
            assert WAITING.fullmatch(status["supervisor"]["waiting"])
            assert (status["supervisor"]["pid"], status["supervisor"]["starts"]) == (pid, 1)  # not stopped
            assert status["engine"]["busy"] is True  # the answer is still there
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.engine_socket)), timeout=30) as client:
                held = client.post("http://engine/v1/chat/completions", json={"messages": HELLO})
            assert held.status_code == 503  # a new request waited request_hold_s, and says why
            assert f"the engine is paused: {status['supervisor']['waiting']}" in held.json()["error"]["message"]

            d.tree.meminfo(total_kb=16_000_000, available_kb=12_000_000)
            got += list(chunks)
        assert [c["choices"][0]["finish_reason"] for c in got if c.get("choices")][-1] == "length"
        assert got[-1]["usage"]["completion_tokens"] == 200  # every token, none lost or repeated at the pause
        status = d.status()
        assert status["supervisor"]["waiting"] is None
        assert (status["supervisor"]["pid"], status["supervisor"]["starts"]) == (pid, 1)
        paused_lines = [e for e in d.events() if e.get("event") == "engine.paused"]
        assert paused_lines
        assert paused_lines[0]["mid_answer"] is True
    finally:
        d.stop()
