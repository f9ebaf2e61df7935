"""Crash loops explain themselves, and the public chat socket answers every request (real daemon and engine
processes; the engine's crash is injected with GOVERNOR_ENGINE_FAULT, a SIGSEGV like llama.cpp's AMX crash)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from policies.ladder import load_ladder
from tests.governor.daemon.daemon_proc import DaemonProc
from tests.helpers import eventually

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "hello"}]
CRASH_CONFIG = "request_hold_s = 0.5\n[restart]\ninitial_s = 0.2\nfactor = 2.0\nmax_s = 5.0\nmax_failures = 3\n"


def public(d: DaemonProc) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(d.engine_socket)), base_url="http://engine", timeout=60)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"messages": HELLO, "max_tokens": 8, **extra}


def cli(d: DaemonProc, *args: str) -> str:
    argv = [sys.executable, "-m", "governor", args[0], "--control-socket", str(d.control), *args[1:]]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, check=False, env=os.environ | {"COLUMNS": "400"}
    )
    return done.stdout + done.stderr


def engine_takes_extra_buffers() -> bool:
    """The safer setting the supervisor passes first (`--extra-buffers off`) is the engine half of issue 9."""
    argv = [sys.executable, "-m", "governor", "engine", "--help"]
    return "--extra-buffers" in subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False).stdout


needs_extra_buffers = pytest.mark.skipif(
    not engine_takes_extra_buffers(), reason="governor engine has no --extra-buffers yet (issue 9, engine side)"
)


def two_tiers(ladder: Path) -> tuple[str, str]:
    tiers = [t.name for t in load_ladder(ladder).tiers]
    return tiers[0], tiers[1]


@needs_extra_buffers
def test_a_crash_at_every_load_backs_off_tries_safer_settings_then_gives_up_and_says_why(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path
) -> None:
    large, medium = two_tiers(demo_ladder)
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, config=CRASH_CONFIG, env={"GOVERNOR_ENGINE_FAULT": "load"})
    try:
        eventually(d.engine_socket.exists, timeout_s=30)
        with public(d) as http:
            # While the engine restarts, a request waits request_hold_s for it, then gets a 503 that says why.
            r = http.post("/v1/chat/completions", json=chat_body())
            assert r.status_code == 503
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "server_error"
            assert err["code"] in ("engine_starting", "engine_unavailable")

            # The supervisor gives up, then wakes the loop, whose next decision says critical: wait for both.
            status = eventually(
                lambda: (s := d.status())["supervisor"]["critical"] and s["state"] == "critical" and s, timeout_s=90
            )
            critical = status["supervisor"]["critical"]
            assert critical.startswith(f"engine crashes: SIGSEGV during load of tier {large}, 3 times in ")
            assert f"; tried extra buffers off and tier {medium}; last engine stderr: " in critical
            assert critical.endswith(f"GOVERNOR_ENGINE_FAULT=load: SIGSEGV at load of tier {medium}")
            assert status["state"] == "critical"
            assert status["supervisor"]["starts"] == 3

            # Exponential back-off between the three starts, then no more starts.
            delays = [e["delay_s"] for e in d.events() if e.get("event") == "engine died; restarting"]
            assert delays == [0.2, 0.4]
            starts = [e for e in d.events() if e.get("event") == "engine started"]
            assert [(e["model"], e["extra_buffers"]) for e in starts] == [
                (large, None),
                (large, "off"),
                (medium, "off"),
            ]

            # Given up: 503 at once, with the crash-loop reason and a Retry-After.
            r = http.post("/v1/chat/completions", json=chat_body(stream=True))
            assert r.status_code == 503
            assert r.headers["retry-after"] == "5"
            assert r.json()["error"]["code"] == "engine_unavailable"
            assert critical in r.json()["error"]["message"]

        assert f"given up: engine crashes: SIGSEGV during load of tier {large}" in cli(d, "status")
        assert f"critical: engine crashes: SIGSEGV during load of tier {large}" in cli(d, "why")
        assert d.status()["supervisor"]["starts"] == 3
    finally:
        assert d.stop() == 0


@needs_extra_buffers
def test_a_crash_in_the_first_decode_steps_down_until_an_engine_answers(
    tmp_path: Path, sock_dir: Path, demo_ladder: Path
) -> None:
    # Like the AMX crash: tier large dies at its first decode; the daemon answers each doomed request with a 502
    # that names the crash, and ends on tier medium (with extra buffers off), which answers.
    large, medium = two_tiers(demo_ladder)
    fault = {"GOVERNOR_ENGINE_FAULT": f"decode@{large}"}
    d = DaemonProc(tmp_path, sock_dir, demo_ladder, config=CRASH_CONFIG, env=fault)
    try:
        d.wait_ready()
        with public(d) as http:
            r = http.post("/v1/chat/completions", json=chat_body())  # no model: the engine's current tier
            assert r.status_code == 502
            err = r.json()["error"]
            assert err["code"] == "engine_died"
            assert err["message"].startswith("the engine died while answering: engine killed by SIGSEGV after ")
            assert err["message"].endswith(", in the first decode; restarting with extra buffers off")

            d.wait_ready()
            r = http.post("/v1/chat/completions", json=chat_body(stream=True))  # died before the first byte: 502
            assert r.status_code == 502
            assert r.json()["error"]["message"].endswith(f", in the first decode; restarting with tier {medium}")

        status = d.wait_ready()
        answer = d.engine.chat(HELLO, model=medium, max_tokens=8, ignore_eos=True)
        assert answer["usage"]["completion_tokens"] == 8
        assert answer["model"] == medium
        sup = status["supervisor"]
        assert sup["critical"] is None
        assert sup["extra_buffers"] == "off"
        assert sup["crashes"].startswith(f"engine crashes: SIGSEGV in the first decode of tier {large}, 2 times in ")
        assert sup["crashes"].endswith(
            f"; tried extra buffers off and tier {medium}; "
            f"last engine stderr: GOVERNOR_ENGINE_FAULT=decode@{large}: SIGSEGV at decode of tier {large}"
        )
        assert f"engine crashes: SIGSEGV in the first decode of tier {large}" in cli(d, "status")
    finally:
        assert d.stop() == 0


def test_the_engine_dying_under_requests_ends_them_with_errors_not_silence(daemon: DaemonProc) -> None:
    # Streamed: the chunks so far, then an error event and [DONE] -- never a stream that just stops.
    with public(daemon) as http:
        body = chat_body(max_tokens=4000, ignore_eos=True, stream=True)
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["object"] == "chat.completion.chunk"
            os.kill(daemon.status()["supervisor"]["pid"], signal.SIGKILL)
            rest = [line[5:].strip() for line in lines if line.startswith("data:")]
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["code"] == "engine_died"
        assert err["message"].startswith("the engine died while answering: engine killed by SIGKILL after ")
        assert all("choices" in json.loads(chunk) for chunk in rest[:-2])

        # Non-streamed: a 502 with the OpenAI error shape (never an empty reply or a truncated 200).
        daemon.wait_ready()
        got: list[httpx.Response] = []
        asking = threading.Thread(
            target=lambda: got.append(
                http.post("/v1/chat/completions", json=chat_body(max_tokens=4000, ignore_eos=True))
            )
        )
        asking.start()
        eventually(lambda: daemon.engine.status().busy, timeout_s=30)
        os.kill(daemon.status()["supervisor"]["pid"], signal.SIGKILL)
        asking.join(60)
        assert got[0].status_code == 502
        assert got[0].json()["error"]["message"].startswith("the engine died while answering: engine killed by SIGKILL")
        assert int(got[0].headers["retry-after"]) >= 1


def test_openai_sdk_and_curl_through_the_public_socket(daemon: DaemonProc) -> None:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.engine_socket)))
    client = openai.OpenAI(base_url="http://engine/v1", api_key="x", http_client=http)  # type: ignore[arg-type]
    extra = {"ignore_eos": True}
    with client:
        assert {m.id for m in client.models.list()} >= {"large", "medium", "small"}
        done = client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_body=extra
        )
        assert done.usage is not None
        assert done.usage.completion_tokens == 5
        chunks = list(
            client.chat.completions.create(
                model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True, extra_body=extra
            )
        )
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        # The engine killed mid-stream: the SDK raises on the error event instead of ending quietly.
        long = client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=4000, stream=True, extra_body=extra
        )
        next(iter(long))
        os.kill(daemon.status()["supervisor"]["pid"], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="the engine died while answering"):
            list(long)
    if shutil.which("curl") is not None:
        daemon.wait_ready()
        body = json.dumps({"messages": HELLO, "max_tokens": 4, "stream": True, "ignore_eos": True})
        out = subprocess.run(
            ["curl", "-sSN", "--unix-socket", str(daemon.engine_socket), "http://engine/v1/chat/completions",
             "-H", "Content-Type: application/json", "-d", body],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert out.stdout.rstrip().endswith("data: [DONE]")
