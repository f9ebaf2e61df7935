"""LoRA adapters per request (issue 32), measured on the real model (SmolLM2-135M-Instruct) through the engine's socket.

    .venv/bin/python bench/bench_adapters.py [--rounds 9]     # on a quiet machine: a few minutes

Prints, as medians of interleaved rounds, one engine thread each:
- switch latency: a request whose adapter differs from the previous answer's, with that adapter in the pool (a hit),
  read from its file (a miss: from the page cache, and from storage with the file dropped from the page cache
  first), each minus a request of the same length with no switch (goal for a hit: < 50 ms). Every prompt starts
  with a different word, so no request reuses a cached prefix: the difference is the switch alone (parking the
  outgoing cache, llama.cpp's adapter load and its compute graph re-reserved at the next decode). Each as wall
  clock and as the engine process's CPU time (steadier on a shared machine: the work is CPU-bound);
- the engine's RSS after serving 20 adapters in turn (each twice) from a 4 MB pool, ÷ its RSS after as many answers
  with 1 adapter and the same pool (goal: within 5 %), and with no adapter at all;
- decode tokens/s with an adapter ÷ the base model alone (128 tokens, the engine's own decode rate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.governor.engine.engine_proc import Engine  # noqa: E402

POOL_4MB = 4e6 / 2**20  # MiB
WORDS = ["apple", "river", "stone", "cloud", "paper", "garden", "window", "candle", "forest", "silver", "bridge"]


def demo_ladder(directory: Path) -> Path:
    """`governor demo-models` (the SmolLM2 tiers and their two adapters), in a child: it quantizes with llama.cpp."""
    cmd = [sys.executable, "-m", "governor", "demo-models", "--dir", str(directory)]
    subprocess.run(cmd, check=True, capture_output=True)
    return directory / "ladder.toml"


def with_adapters(ladder: Path, out: Path, names: Sequence[str]) -> Path:
    """`ladder`'s tiers plus `names` adapters, each its own copy of one of the demo adapters (files differ: each is
    read and loaded on its own)."""
    text = ladder.read_text().split("\n[[adapter]]")[0]
    sources = sorted(ladder.parent.glob("*-lora.gguf"))
    for i, name in enumerate(names):
        copy = out / f"{name}.gguf"
        shutil.copyfile(sources[i % len(sources)], copy)
        text += f'\n[[adapter]]\nname = "{name}"\npath = "{copy}"\nbase = "medium"\n'
    path = out / f"ladder-{len(names)}.toml"
    path.write_text(text.replace('path = "smollm2', f'path = "{ladder.parent}/smollm2'))
    return path


def ask(i: int, adapter: str | None, *, tokens: int = 1) -> dict[str, Any]:
    # The first word differs every request: nothing after the template's first tokens is a cached prefix.
    word = f"{WORDS[i % len(WORDS)]}{i}"
    body: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": f"{word}. You are a helpful assistant."},
            {"role": "user", "content": "Name one colour of the rainbow."},
        ],
        "temperature": 0.0,
        "max_tokens": tokens,
    }
    if adapter is not None:
        body["governor"] = {"adapter": adapter}
    return body


def timed(engine: Engine, body: dict[str, Any]) -> tuple[float, float]:
    """The request's wall-clock seconds and the engine process's CPU seconds for it (all its threads). On a shared
    machine the CPU time is the steadier figure: the engine's work is CPU-bound, and waiting for a core adds none."""
    proc = psutil.Process(engine.proc.pid)
    c0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
    r = engine.chat(**body)
    seconds, cpu = time.perf_counter() - t0, sum(proc.cpu_times()[:2]) - c0
    assert r.status_code == 200, r.text
    return seconds, cpu


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def switch_latency(tmp: Path, ladder: Path, rounds: int) -> dict[str, list[float]]:
    """Milliseconds over a same-adapter request: a hit (pool of 64 MiB holds both), a miss from the page cache and
    a miss from storage (a pool that holds one adapter: every switch evicts the other)."""
    kinds = ("same", "hit", "miss_cached", "miss_storage", "init_ms")
    out: dict[str, list[float]] = {k + cpu: [] for k in kinds for cpu in ("", "_cpu")}
    pooled = Engine(tmp / "pooled", "--models", str(ladder), "--tier", "medium", "--threads", "1")
    small = Engine(tmp / "small", "--models", str(ladder), "--tier", "medium", "--threads", "1", "--lora-pool-mib", "2")
    try:
        names = ["french", "json"]
        paths = {a["adapter"]: a for a in pooled.http.get("/v1/models").json()["data"] if a.get("adapter")}
        assert set(names) <= set(paths), paths
        files = {n: ladder.parent / f"smollm2-135m-{n}-lora.gguf" for n in names}
        i = 0
        for name in [*names, *names]:  # both in the pool; the page cache warm
            timed(pooled, ask(i := i + 1, name))
            timed(small, ask(i := i + 1, name))
        for r in range(rounds):
            this, other = names[r % 2], names[(r + 1) % 2]
            timed(pooled, ask(i := i + 1, other))
            hit = timed(pooled, ask(i := i + 1, this))  # switch, in the pool
            same = timed(pooled, ask(i := i + 1, this))  # no switch
            timed(small, ask(i := i + 1, other))  # evicts `this`
            miss_cached = timed(small, ask(i := i + 1, this))
            same_small = timed(small, ask(i := i + 1, this))
            timed(small, ask(i := i + 1, other))
            drop_page_cache(files[this])
            miss_storage = timed(small, ask(i := i + 1, this))
            for i_cpu, cpu in enumerate(("", "_cpu")):  # wall clock, then the engine's CPU time
                out["same" + cpu].append(same[i_cpu] * 1000)
                out["hit" + cpu].append((hit[i_cpu] - same[i_cpu]) * 1000)
                out["miss_cached" + cpu].append((miss_cached[i_cpu] - same_small[i_cpu]) * 1000)
                out["miss_storage" + cpu].append((miss_storage[i_cpu] - same_small[i_cpu]) * 1000)
        out["init_ms"] = [e["seconds"] * 1000 for e in small.log_events("engine.adapter_loaded")]
    finally:
        pooled.stop()
        small.stop()
    return out


def rss_after(tmp: Path, ladder: Path, names: Sequence[str | None], answers: int, pool_mib: float) -> int:
    engine = Engine(
        tmp, "--models", str(ladder), "--tier", "medium", "--threads", "1", "--lora-pool-mib", str(pool_mib)
    )
    try:
        for i in range(answers):
            timed(engine, ask(i, names[i % len(names)], tokens=4))
        status = engine.status()
        assert status["lora_pool"]["used_bytes"] <= pool_mib * 2**20, status["lora_pool"]
        return int(status["rss_bytes"])
    finally:
        engine.stop()


def decode_ratio(tmp: Path, ladder: Path, rounds: int) -> dict[str, list[float]]:
    engine = Engine(tmp / "decode", "--models", str(ladder), "--tier", "medium", "--threads", "1")
    rates: dict[str, list[float]] = {"base": [], "french": [], "json": []}
    try:
        for r in range(rounds):
            for name in ("base", "french", "json"):
                body = {**ask(r, None if name == "base" else name, tokens=128), "ignore_eos": True}
                reply = engine.chat(**body).json()
                rates[name].append(reply["governor"]["decode_tokens_per_s"])
    finally:
        engine.stop()
    return rates


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    med = statistics.median
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        ladder = demo_ladder(tmp / "demo")
        for sub in ("pooled", "small", "decode", "r20", "r1", "r0"):
            (tmp / sub).mkdir()
        lat = switch_latency(tmp, ladder, args.rounds)
        twenty = [f"task{i:02d}" for i in range(20)]
        ladder20 = with_adapters(ladder, tmp / "r20", twenty)
        ladder1 = with_adapters(ladder, tmp / "r1", twenty[:1])
        answers = 2 * len(twenty)
        rss20 = rss_after(tmp / "r20", ladder20, twenty, answers, POOL_4MB)
        rss1 = rss_after(tmp / "r1", ladder1, twenty[:1], answers, POOL_4MB)
        rss0 = rss_after(tmp / "r0", ladder1, [None], answers, POOL_4MB)
        rates = decode_ratio(tmp, ladder, args.rounds)
    mib = 2**20
    print(f"SmolLM2-135M-Instruct medium (Q4_1), 1 thread, {args.rounds} interleaved rounds (medians)")
    print("wall clock ms / the engine's CPU ms:")
    print(f"request without a switch: {med(lat['same']):.1f} / {med(lat['same_cpu']):.1f} ms (1 token, ~40-token "
          "prompt, nothing cached)")  # fmt: skip
    for kind, what in (("hit", "adapter in the pool"), ("miss_cached", "miss from the page cache"),
                       ("miss_storage", "miss from storage")):  # fmt: skip
        goal = "   (goal < 50 ms)" if kind == "hit" else ""
        print(f"switch latency, {what + ':':26} {med(lat[kind]):6.1f} / {med(lat[kind + '_cpu']):6.1f} ms{goal}")
    print(f"  llama_adapter_lora_init as the engine logs it: {med(lat['init_ms']):.1f} ms (1.8 MB f16 adapter)")
    print(
        f"RSS after {answers} answers, 4 MB pool: 20 adapters {rss20 / mib:.1f} MiB, 1 adapter {rss1 / mib:.1f} MiB, "
        f"none {rss0 / mib:.1f} MiB: 20 / 1 = {rss20 / rss1:.3f} (goal within 5 %)"
    )
    base = med(rates["base"])
    for name in ("french", "json"):
        print(f"decode {name} {med(rates[name]):.1f} tok/s ÷ base {base:.1f} tok/s = {med(rates[name]) / base:.3f}")
    print(json.dumps({"latency_ms": lat, "rss": [rss20, rss1, rss0], "decode": rates}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
