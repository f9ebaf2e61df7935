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
from typing import Any

import httpx
import openai
import pytest

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
