"""`governor run --engine external`: a server the governor does not start, governed with what does not depend on the
engine. End to end against a llama-server this test starts itself on a TCP port; Ollama cannot run here, so its
per-request options are checked against the shape of its documented native API (api/types.go: ChatRequest's
`options` map with `num_thread`, `num_ctx`, and `keep_alive`), and named as such in docs/engines.md."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from governor.daemon.external import External, ExternalError, listening_pid, ollama_options, parse_url
from governor.demo.models import smollm2_path
from governor.engine.client import EngineError
from governor.programs import find_program
from policies.decision import EngineConfig
from tests.governor.daemon.daemon_proc import TEST_POLICY, DaemonProc, device_tree
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

ZONE_TEMP = "sys/class/thermal/thermal_zone0/temp"
CONFIG = EngineConfig(threads=3, n_ctx=1024, model="medium", max_tokens_per_s=5.0)


def test_ollamas_native_chat_gets_the_decided_threads_context_and_idle_unload() -> None:
    body = {"model": "llama3.2:1b", "messages": [{"role": "user", "content": "hi"}], "stream": False}

    out = ollama_options(body, CONFIG, keep_alive_s=300.0)

    assert out["options"] == {"num_thread": 3, "num_ctx": 1024}
    assert out["keep_alive"] == "300s"
    assert out["messages"] == body["messages"]


def test_a_clients_own_options_stay_but_never_ask_more_context_than_decided() -> None:
    body = {"model": "m", "prompt": "hi", "options": {"temperature": 0.2, "num_ctx": 8192}, "keep_alive": "10m"}

    out = ollama_options(body, CONFIG, keep_alive_s=300.0)

    assert out["options"] == {"temperature": 0.2, "num_thread": 3, "num_ctx": 1024}
    assert out["keep_alive"] == "10m"  # the client's own
    assert ollama_options({**body, "options": {"num_ctx": 512}}, CONFIG, 0.0)["options"]["num_ctx"] == 512


def test_rewrite_only_touches_json_objects_on_the_paths_that_read_them() -> None:
    ext = External("http://127.0.0.1:9", models={"medium": "llama3.2:1b", "small": "qwen2.5:0.5b"})
    ext.running, ext.ollama = CONFIG, True
    chat = json.dumps({"model": "qwen2.5:0.5b", "messages": []}).encode()

    native = json.loads(ext.rewrite("/api/chat", chat))
    assert native["options"]["num_thread"] == 3
    assert native["model"] == "llama3.2:1b"  # the decided tier's model, from the map
    openai = json.loads(ext.rewrite("/v1/chat/completions", chat))
    assert "options" not in openai  # Ollama's OpenAI-compatible API has no options field: nothing to inject
    assert openai["model"] == "llama3.2:1b"
    assert json.loads(ext.rewrite("/v1/chat/completions", b'{"model": "mine", "messages": []}'))["model"] == "mine"
    for odd in (b"", b"[1, 2]", b"{not json", b'"a string"'):
        assert ext.rewrite("/api/chat", odd) == odd
    assert ext.rewrite("/api/pull", chat) == chat
    ext.close()


def test_the_engine_url_is_a_local_http_address_or_a_socket() -> None:
    assert parse_url("http://127.0.0.1:11434") == ("127.0.0.1", 11434)
    assert parse_url("unix:/run/llama/server.sock") == Path("/run/llama/server.sock")
    for bad in ("https://example.com", "http://127.0.0.1:11434/v1", "ftp://x", "127.0.0.1:11434"):
        with pytest.raises(ExternalError, match="--engine-url"):
            parse_url(bad)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def user_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The user's own llama-server (SmolLM2, its own flags) on a TCP port."""
    port = free_port()
    argv = [str(find_program("llama-server")), "-m", str(smollm2_path()), "--host", "127.0.0.1", "--port", str(port),
            "-t", "2", "-c", "2048", "-np", "1", "--no-webui", "-lv", "1"]  # fmt: skip
    with (tmp_path / "server.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    yield proc, port
    proc.terminate()
    proc.wait(30)


def clocked(root: Path) -> FakeTree:
    tree = device_tree(root)
    tree.cluster(0, range(4), max_khz=2_400_000, min_khz=600_000, available=(600_000, 1_200_000, 1_800_000, 2_400_000))
    return tree


LISTEN = "import socket, sys; s = socket.create_server((sys.argv[1], int(sys.argv[2]))); print(flush=True); input()"


def test_the_engine_is_the_process_listening_at_its_address_not_another_on_its_port() -> None:
    """A local user's server on the engine's port at another loopback address is never taken for the engine (its
    threads would be pinned by the daemon); the one bound to the address is."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with contextlib.ExitStack() as stack:
        listeners = []
        for host in ("127.0.0.2", "127.0.0.1"):  # the other user's first: a scan that takes any listener finds it
            argv = [sys.executable, "-c", LISTEN, host, str(port)]
            proc = stack.enter_context(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            stack.callback(proc.kill)
            listeners.append(proc)
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"\n"  # listening
        assert listening_pid(("127.0.0.1", port)) == listeners[1].pid
        assert listening_pid(("localhost", port)) == listeners[1].pid
        assert listening_pid(("127.0.0.2", port)) == listeners[0].pid


@pytest.mark.slow
def test_an_external_server_is_governed_by_affinity_pace_and_clock_and_says_what_it_cannot(
    tmp_path: Path, sock_dir: Path, real_ladder: Path, user_server: tuple[subprocess.Popen[bytes], int]
) -> None:
    server, port = user_server
    found = os.sched_getaffinity(server.pid)
    policy = TEST_POLICY.replace("threads = 4\n", "threads = 2\n").replace(
        "[states.hot]\nthreads = 2\nmin_threads = 1\n", "[states.hot]\nthreads = 1\nmin_threads = 1\n"
    )
    config = f'engine = "external"\nengine_url = "http://127.0.0.1:{port}"\n[restart]\ninitial_s = 0.2\n'
    d = DaemonProc(tmp_path / "d", sock_dir, real_ladder, policy=policy, config=config, tree=clocked)
    try:
        status = d.wait_ready(timeout_s=180)
        driver = status["actuators"]["engine"]["driver"]
        assert driver["engine"] == "external"
        assert driver["managed"] is False
        assert set(driver["live"]) == {"threads", "max_tokens_per_s"}  # by affinity; paced
        assert set(driver["cannot"]) == {"n_ctx", "kv_type", "model", "n_batch", "lora_pool_mib"}
        assert driver["restart"] == []
        assert status["supervisor"]["pid"] == server.pid  # found by the port it listens on
        eventually(lambda: len(os.sched_getaffinity(server.pid)) == 2, timeout_s=30)

        answer = d.engine.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=16)
        assert answer["choices"][0]["message"]["content"].strip()

        d.tree.write(ZONE_TEMP, 95000)  # hot: one thread (pinned) and the clock capped, whatever the engine
        eventually(lambda: d.status()["state"] == "hot", timeout_s=30)
        eventually(lambda: len(os.sched_getaffinity(server.pid)) == 1, timeout_s=30)
        max_freq = d.tree.path("sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq")
        eventually(lambda: int(max_freq.read_text()) < 2_400_000, timeout_s=30)
        assert server.poll() is None  # never restarted: it is not the governor's
    finally:
        assert d.stop() == 0
    assert os.sched_getaffinity(server.pid) == found  # put back as found


@pytest.mark.slow
def test_a_server_that_goes_away_is_waited_for_and_requests_get_a_503_saying_why(
    tmp_path: Path, sock_dir: Path, real_ladder: Path
) -> None:
    port = free_port()
    config = (f'engine = "external"\nengine_url = "http://127.0.0.1:{port}"\nrequest_hold_s = 0.5\n'
              "[restart]\ninitial_s = 0.2\nprobe_interval_s = 0.5\n")  # fmt: skip
    d = DaemonProc(tmp_path / "d", sock_dir, real_ladder, policy=TEST_POLICY, config=config)
    try:
        eventually(lambda: d.control.exists() and d.status(), timeout_s=60)
        with pytest.raises(EngineError, match=rf"HTTP 503: the external engine at http://127.0.0.1:{port} does not"):
            d.engine.chat([{"role": "user", "content": "hi"}], max_tokens=4)
        assert not d.status()["supervisor"]["ready"]
    finally:
        assert d.stop() == 0
