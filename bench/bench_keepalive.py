"""Idle unload and structured output, measured on the real model (SmolLM2-135M-Instruct) through the engine's socket.

    .venv/bin/python bench/bench_keepalive.py [--rounds 5]

Prints, as medians of interleaved rounds:
- time to first token (streamed) of a request that finds the model unloaded (it waits for the load, the warm-up and
  its prefill) next to a request of the same length on a warm engine (another question: no cached prompt to reuse),
  and their ratio; the load time the engine reports;
- the engine's RSS loaded, after an idle unload, and of a bare engine process (its imports and llama.cpp's backend,
  no model): unloaded ÷ bare (goal <= 1.1);
- decode rate with a json_schema grammar ÷ without (the grammar sampler runs over the whole vocabulary per token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.governor.engine.engine_proc import Engine, real_model  # noqa: E402
from tests.governor.engine.test_idle import BARE_ENGINE  # noqa: E402
from tests.helpers import eventually  # noqa: E402

ASK = [{"role": "user", "content": "Tell me about the sea in three sentences."}]
TOPICS = ["the sea", "mountains", "a city at night", "winter", "a small boat", "the desert", "a library", "rain"]


def ask(i: int) -> list[dict[str, str]]:
    """A different question each call: no request reuses the cached prompt of the one before (beyond the template)."""
    return [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} in three sentences ({i})."}]


SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "maxLength": 400}},
    "required": ["story"],
}


def ttft(engine: Engine, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first content chunk, X-Governor-Load-S or 0)."""
    t0 = time.perf_counter()
    with engine.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        load_s = float(r.headers.get("X-Governor-Load-S", 0.0))
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - t0, load_s
    raise AssertionError("no content")


def decode_rate(engine: Engine, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    r = engine.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return float(r.json()["usage"]["completion_tokens"]) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model = real_model()
    body: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(Path(tmp), "--model", str(model), "--threads", "1", "--keep-alive", "2")
        try:
            cold: list[float] = []
            warm: list[float] = []
            loads: list[float] = []
            rss_loaded: list[int] = []
            rss_unloaded: list[int] = []
            for i in range(args.rounds):
                eventually(lambda: engine.status()["loaded"] is False, timeout_s=60)
                rss_unloaded.append(engine.status()["rss_bytes"])
                seconds, load_s = ttft(engine, {**body, "messages": ask(2 * i)})
                cold.append(seconds)
                loads.append(load_s)
                warm.append(ttft(engine, {**body, "messages": ask(2 * i + 1)})[0])
                rss_loaded.append(engine.status()["rss_bytes"])
            plain = {"messages": ASK, "max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
            fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
            with_grammar = {**plain, "response_format": fmt}
            rates: dict[str, list[float]] = {"plain": [], "grammar": []}
            for _ in range(args.rounds):
                rates["plain"].append(decode_rate(engine, plain))
                rates["grammar"].append(decode_rate(engine, with_grammar))
        finally:
            engine.stop()
    bare = int(subprocess.run([sys.executable, "-c", BARE_ENGINE], capture_output=True, text=True, check=True).stdout)
    med = statistics.median
    mib = 2**20
    print(f"model {model.name}, 1 thread, {args.rounds} interleaved rounds (medians)")
    print(f"TTFT after idle unload {med(cold):.3f} s (of which load+warm-up {med(loads):.3f} s)")
    print(f"TTFT warm              {med(warm):.3f} s   ratio {med(cold) / med(warm):.1f}x")
    print(
        f"RSS loaded {med(rss_loaded) / mib:.1f} MiB, unloaded {med(rss_unloaded) / mib:.1f} MiB, "
        f"bare engine {bare / mib:.1f} MiB: unloaded / bare {med(rss_unloaded) / bare:.3f} (goal <= 1.1)"
    )
    p, g = med(rates["plain"]), med(rates["grammar"])
    print(f"decode (48 tokens incl. prefill) plain {p:.1f} tok/s, json_schema grammar {g:.1f} tok/s: ratio {g / p:.3f}")
    print(json.dumps({"cold": cold, "warm": warm, "loads": loads, "rates": rates}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
