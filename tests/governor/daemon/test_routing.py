"""Routing to an upstream, end to end: a real `governor run` on the random demo models, and a second real
`governor engine` serving the real SmolLM2 model as its upstream (so an answer's model says where it ran)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from tests.governor.daemon.daemon_proc import TEST_POLICY, DaemonProc, device_tree
from tests.governor.engine.engine_proc import Engine
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

pytestmark = pytest.mark.slow

ZONE_TEMP = "sys/class/thermal/thermal_zone0/temp"
SECRET = "sk-test-NEVER-SHOWN-5f3a9c"
UPSTREAM_MODEL = "smollm2-135m-instruct-q4_0"
HELLO = [{"role": "user", "content": "What is the capital of France?"}]
# Hot caps the decode rate at 0.5-1 tok/s, below the 3 tok/s target: hot -> off the device.
ROUTING_POLICY = (
    TEST_POLICY.replace(
        "max_tokens_per_s = 60.0\nmin_tokens_per_s = 20.0", "max_tokens_per_s = 1.0\nmin_tokens_per_s = 0.5"
    )
    + "[slo]\nmin_tokens_per_s = 3.0\nback_margin = 0.1\nback_after_s = 0.5\n"
)


def upstream_config(sock: Path, key_file: Path, restart: str = "initial_s = 0.2", **extra: Any) -> str:
    lines = [
        "request_hold_s = 2.0",
        "[restart]",
        restart,
        "[[upstream]]",
        'name = "lan"',
        'base_url = "http://upstream/v1"',
        f'socket = "{sock}"',
        f'api_key_file = "{key_file}"',
        f'model = "{UPSTREAM_MODEL}"',
        *(f"{k} = {json.dumps(v)}" for k, v in extra.items()),
    ]
    return "\n".join(lines) + "\n"


def public(d: DaemonProc) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(d.engine_socket)), base_url="http://engine", timeout=120)


def chat(http: httpx.Client, **extra: Any) -> httpx.Response:
    headers = extra.pop("headers", {})
    body = {"messages": HELLO, "max_tokens": 8, "temperature": 0.0, **extra}
    r = http.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


def route_of(r: httpx.Response) -> tuple[str, str]:
    body = r.json()
    assert body["governor"]["route"] == r.headers["x-governor-route"]
    return r.headers["x-governor-route"], body["model"]


def cli(d: DaemonProc, *args: str) -> str:
    argv = [sys.executable, "-m", "governor", args[0], "--control-socket", str(d.control), *args[1:]]
    env = os.environ | {"COLUMNS": "400"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)
    return done.stdout + done.stderr


def hot_tree(root: Path) -> FakeTree:
    tree = device_tree(root)
    tree.write(ZONE_TEMP, 92000)
    return tree


@pytest.fixture
def upstream(tmp_path: Path, sock_dir: Path, real_ladder: Path) -> Iterator[Engine]:
    directory = sock_dir / "up"
    directory.mkdir()
    engine = Engine(directory, "--model", str(real_ladder.parent / f"{UPSTREAM_MODEL}.gguf"), "--threads", "1")
    yield engine
    engine.proc.kill()
    engine.proc.wait()
    engine.http.close()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "lan.key"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def test_routed_when_hot_back_when_cool_local_only_honoured_key_never_shown(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path, upstream: Engine, key_file: Path
) -> None:
    textfile = tmp_path / "governor.prom"
    config = f'metrics_textfile = "{textfile}"\n' + upstream_config(upstream.socket, key_file)
    d = DaemonProc(tmp_path / "d", sock_dir, demo_ladder, policy=ROUTING_POLICY, config=config)
    try:
        d.wait_ready()
        with public(d) as http:
            # Cool: on the device (the random demo model answers).
            assert route_of(chat(http)) == ("local", "large")

            # Hot: the rate cap cannot meet 3 tok/s, so the next request runs upstream, on the real model.
            d.tree.write(ZONE_TEMP, 92000)
            eventually(lambda: d.status()["routing"]["off_device"], timeout_s=30)
            r = chat(http)
            assert route_of(r) == ("upstream:lan", UPSTREAM_MODEL)
            assert "cannot meet the target" in r.json()["governor"]["why"]
            assert "Paris" in r.json()["choices"][0]["message"]["content"]

            # The request (body or header) may forbid leaving the device.
            assert route_of(chat(http, governor={"local_only": True}, max_tokens=2))[0] == "local"
            assert route_of(chat(http, headers={"x-governor-local-only": "1"}, max_tokens=2))[0] == "local"

            # The openai SDK streams from the upstream as from the engine, the route in the first chunk.
            sdk = openai.OpenAI(base_url="http://engine/v1", api_key="x", http_client=public(d))  # type: ignore[arg-type]
            with sdk:
                raw = sdk.chat.completions.with_raw_response.create(
                    model="large",  # the device's tier: the upstream's `model` replaces it
                    messages=HELLO,  # type: ignore[arg-type]
                    max_tokens=12,
                    temperature=0.0,
                    stream=True,
                )
                assert raw.headers["x-governor-route"] == "upstream:lan"
                stream = raw.parse()
                assert isinstance(stream, openai.Stream)
                chunks: list[ChatCompletionChunk] = list(stream)
            assert {c.model for c in chunks} == {UPSTREAM_MODEL}
            assert (chunks[0].model_extra or {})["governor"]["route"] == "upstream:lan"
            assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")

            status_text = cli(d, "status")
            assert "off the device" in status_text
            assert "upstream lan" in status_text

            # Cool again: back on the device once the prediction beats the target with margin (hysteresis).
            d.tree.write(ZONE_TEMP, 45000)
            eventually(lambda: not d.status()["routing"]["off_device"], timeout_s=30)
            assert route_of(chat(http)) == ("local", "large")

        why = cli(d, "why", "-n", "20")
        assert "upstream:lan" in why
        assert "local_only" in why
        metrics = d.client.request("metrics")["text"]
        assert 'governor_requests_total{reason="slo",route="upstream"}' in metrics
        assert 'governor_request_ttft_seconds_count{route="upstream"}' in metrics
        eventually(lambda: "governor_requests_total" in textfile.read_text(), timeout_s=15)
        status = json.dumps(d.status())
        assert '"api_key": "set"' in status
        for shown in (status, why, metrics, status_text, d.log(), textfile.read_text()):
            assert SECRET not in shown
        assert d.status()["routing"]["upstreams"][0]["requests"] >= 2
    finally:
        assert d.stop() == 0


def stream_until_killed(http: httpx.Client, upstream: Engine) -> dict[str, Any]:
    """A streamed request that runs upstream; the upstream is killed after its first token. The error event."""
    body = {"messages": HELLO, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as s:
        assert s.headers["x-governor-route"] == "upstream:lan"
        lines = s.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        assert first["governor"]["route"] == "upstream:lan"
        upstream.proc.kill()
        rest = [line[5:].strip() for line in lines if line.startswith("data:")]
    assert rest[-1] == "[DONE]"
    assert all("choices" in json.loads(chunk) for chunk in rest[:-2])
    error: dict[str, Any] = json.loads(rest[-2])["error"]
    return error


def test_an_upstream_dying_before_the_first_token_falls_back_and_after_it_ends_with_an_error(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path, real_ladder: Path, key_file: Path
) -> None:
    up_dir = sock_dir / "up"
    up_dir.mkdir()
    sock = up_dir / "engine.sock"
    config = upstream_config(sock, key_file, retry_after_s=0.0)
    d = DaemonProc(tmp_path / "d", sock_dir, demo_ladder, policy=ROUTING_POLICY, config=config, tree=hot_tree)
    try:
        d.wait_ready()
        eventually(lambda: d.status()["routing"]["off_device"], timeout_s=30)
        with public(d) as http:
            # Nobody listening on the upstream's socket: answered on the device, and the answer says why.
            r = chat(http, max_tokens=2)
            assert route_of(r) == ("local", "large")
            assert "upstream lan failed before the first token" in r.json()["governor"]["why"]

            # An upstream that dies (SIGSEGV) on the request, before any token: the same.
            model = str(real_ladder.parent / f"{UPSTREAM_MODEL}.gguf")
            os.environ["GOVERNOR_ENGINE_FAULT"] = "decode"
            try:
                crashing = Engine(up_dir, "--model", model, "--threads", "1")
            finally:
                del os.environ["GOVERNOR_ENGINE_FAULT"]
            r = chat(http, max_tokens=2)
            assert route_of(r) == ("local", "large")
            crashing.proc.wait(30)
            assert crashing.proc.returncode == -signal.SIGSEGV
            crashing.http.close()

            # Dying after the first token: the stream ends with an error event, never silently.
            slow = Engine(up_dir, "--model", model, "--threads", "1", "--max-tokens-per-s", "4")
            try:
                err = stream_until_killed(http, slow)
            finally:
                slow.proc.kill()
                slow.proc.wait()
                slow.http.close()
            assert err["code"] == "upstream_failed"
            assert err["message"].startswith("upstream lan failed after the first token")
        ups = d.status()["routing"]["upstreams"][0]
        assert ups["errors"] == 3
        assert ups["last_error"].startswith("after first token")
        metrics = d.client.request("metrics")["text"]
        assert 'governor_upstream_errors_total{phase="before_first_token",upstream="lan"} 2.0' in metrics
        assert 'governor_upstream_errors_total{phase="after_first_token",upstream="lan"} 1.0' in metrics
        assert 'governor_requests_total{reason="fallback",route="local"} 2.0' in metrics
        assert SECRET not in d.log()
    finally:
        assert d.stop() == 0


def test_an_engine_that_cannot_start_is_stood_in_for_by_the_upstream(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path, upstream: Engine, key_file: Path
) -> None:
    # The device's engine crashes at every load (then is given up): chat requests are answered upstream, not 503.
    config = upstream_config(upstream.socket, key_file, restart="initial_s = 0.2\nmax_failures = 2")
    env = {"GOVERNOR_ENGINE_FAULT": "load"}
    d = DaemonProc(tmp_path / "d", sock_dir, demo_ladder, policy=ROUTING_POLICY, config=config, env=env)
    try:
        eventually(d.engine_socket.exists, timeout_s=30)
        with public(d) as http:
            r = chat(http)
            assert route_of(r) == ("upstream:lan", UPSTREAM_MODEL)
            assert r.json()["governor"]["why"].startswith("the engine")  # loading, restarting or given up
            eventually(lambda: d.status()["supervisor"]["critical"], timeout_s=60)
            given_up = chat(http)
            assert route_of(given_up) == ("upstream:lan", UPSTREAM_MODEL)
            assert "given up" in given_up.json()["governor"]["why"]
        assert (
            'governor_requests_total{reason="engine_unavailable",route="upstream"} 2.0'
            in d.client.request("metrics")["text"]
        )
    finally:
        d.stop()
