"""llama.cpp's own llama-server under the governor (issue 30), measured side by side in one run.

    .venv/bin/python bench/bench_llama_server.py [--rounds 7] [--tokens 128]

1. Decode through the governor: two copies of the same llama-server (`make setup` builds it; SmolLM2-135M-Instruct Q8_0,
   2 threads, no rate cap), one alone on its socket and one under `governor run --engine llama-server` (the daemon's
   public socket, its status polls, its loop, nothing to change: every state asks the same settings). Each round
   streams the same greedy answer from both, in alternating order (pairs see the same load); the figure is the median
   of the per-round ratios of decode tokens/s (as the client sees it: tokens after the first ÷ time from the first to
   the last), governed ÷ direct. Goal >= 0.98. A third identical server alone is measured in the same rotation: its
   ratio to the first (the A/A control) shows how much two servers differ with nothing between them.
2. A threads change (2 -> 1) on a 1,500-token chat, as the governor applies it: the slot saved, the server restarted,
   the slot restored (governor.daemon.llamaserver), against a cold restart that evaluates the chat again. Timed from
   the change to the new server holding the conversation in its cache; alternating, median of each. Goal restore ÷
   cold <= 0.5.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from governor.daemon.llamaserver import LlamaServer
from governor.demo.smollm2 import write_real_models
from governor.engine.client import EngineClient
from governor.programs import find_program
from policies.decision import RATE_MAX, EngineConfig
from policies.ladder import ModelLadder, load_ladder
from policies.loader import parse_policy

ROOT = Path(__file__).resolve().parent.parent
CONFIG = EngineConfig(threads=2, n_ctx=2048, kv_type="f16", model="large")
POLICY = """
name = "bench-llama-server"
[contention]
enabled = false
"""
STATES = ("idle", "sustained", "low_battery", "critical", "hot")
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]
SAMPLING: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}


def bench_policy() -> str:
    """Every state asks the same settings: nothing is changed while it is measured."""
    states = "".join(f"\n[states.{s}]\nthreads = 2\nmin_threads = 2\nn_ctx = 2048\n" for s in STATES)
    return POLICY + states + f"max_tokens_per_s = {RATE_MAX}\n"  # the last state's: hot must name one


@contextlib.contextmanager
def alone(driver: LlamaServer, config: EngineConfig) -> Iterator[subprocess.Popen[bytes]]:
    """A llama-server started as the daemon would start it, ready, stopped on exit."""
    proc = subprocess.Popen(driver.command(config, None), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        driver.wait_ready(300)
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def governed(work: Path, ladder: Path) -> Iterator[Path]:
    """`governor run --engine llama-server`, its public socket once the engine is ready."""
    (work / "policy.toml").write_text(bench_policy())
    sock = work / "e.sock"
    argv = [sys.executable, "-m", "governor", "run", "--engine", "llama-server", "--models", str(ladder),
            "--policy", str(work / "policy.toml"), "--control-socket", str(work / "c.sock"),
            "--engine-socket", str(sock), "--state-dir", str(work / "state"), "--no-udev"]  # fmt: skip
    with (work / "daemon.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        with EngineClient(sock, timeout_s=30) as client:
            while True:
                with contextlib.suppress(Exception):
                    client.chat(PROMPT, max_tokens=1)
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"governor run not ready: {(work / 'daemon.log').read_text()[-2000:]}")
                time.sleep(0.2)
        yield sock
    finally:
        proc.terminate()
        proc.wait(60)


def decode_rate(sock: Path, tokens: int) -> float:
    with EngineClient(sock, timeout_s=60) as client:
        first = last = 0.0
        for chunk in client.stream_chat(PROMPT, max_tokens=tokens, **SAMPLING):
            if ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content"):
                last = time.perf_counter()
                first = first or last
    return (tokens - 1) / (last - first)


def through_the_governor(ladder_file: Path, ladder: ModelLadder, rounds: int, tokens: int) -> dict[str, Any]:
    """Each round: the governed server, the one alone and an identical second one alone (the A/A control: how far two
    servers with nothing between them differ), in rotating order; the medians of the per-round ratios to `direct`."""
    with tempfile.TemporaryDirectory(prefix="gvb", dir="/tmp") as tmp:
        work = Path(tmp)
        slots = work / "slots"
        slots.mkdir()
        driver = LlamaServer(find_program("llama-server"), ladder, work / "direct.sock", slots)
        twin = LlamaServer(find_program("llama-server"), ladder, work / "control.sock", slots)
        with alone(driver, CONFIG), alone(twin, CONFIG), governed(work, ladder_file) as public:
            sockets = {"direct": work / "direct.sock", "governed": public, "control": work / "control.sock"}
            rates: dict[str, list[float]] = {name: [] for name in sockets}
            for sock in sockets.values():
                decode_rate(sock, 8)
            for i in range(rounds):
                order = list(sockets)[i % 3 :] + list(sockets)[: i % 3]
                for name in order:
                    rates[name].append(decode_rate(sockets[name], tokens))
                print(f"  round {i + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in sockets) + " tok/s")
        driver.close()
        twin.close()
    ratio = {
        name: statistics.median(r / d for r, d in zip(rates[name], rates["direct"], strict=True)) for name in rates
    }
    return {
        "direct_tok_s": statistics.median(rates["direct"]),
        "governed_tok_s": statistics.median(rates["governed"]),
        "ratio": ratio["governed"],
        "control_ratio": ratio["control"],
    }


def chat_prompt(driver: LlamaServer, n_tokens: int) -> list[int]:
    """A chat of about `n_tokens` in the model's own tokens (the server's /tokenize)."""
    words = "the keeper climbed the tower at dusk and lit the lamp while the sea rolled below and gulls cried "
    text = words * (n_tokens // 16)
    tokens: list[int] = driver.request("POST", "/tokenize", json={"content": text}).json()["tokens"]
    return tokens[:n_tokens]


def put_in_cache(driver: LlamaServer, prompt: list[int]) -> None:
    body = {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": 0}
    driver.request("POST", "/completion", json=body, timeout_s=600)


def threads_change(ladder: ModelLadder, rounds: int, chat_tokens: int) -> dict[str, Any]:
    one = CONFIG.model_copy(update={"threads": 1})
    restore_s: list[float] = []
    cold_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="gvb", dir="/tmp") as tmp:
        slots = Path(tmp) / "slots"
        slots.mkdir()
        driver = LlamaServer(find_program("llama-server"), ladder, Path(tmp) / "s.sock", slots)
        for i in range(2 * rounds):
            keep = i % 2 == 0
            proc = subprocess.Popen(driver.command(CONFIG, None), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            driver.wait_ready(300)
            prompt = chat_prompt(driver, chat_tokens)
            put_in_cache(driver, prompt)
            t0 = time.perf_counter()
            if keep:
                driver.prepare_restart(one)  # the slot saved
            proc.terminate()
            proc.wait(30)
            proc = subprocess.Popen(driver.command(one, None), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            driver.wait_ready(300)  # restored here when saved
            if not keep:
                put_in_cache(driver, prompt)  # evaluated again
            took = time.perf_counter() - t0
            (restore_s if keep else cold_s).append(took)
            slot = driver.request("GET", "/slots").json()[0]
            print(f"  {'restore' if keep else 'cold   '}: {took:.2f} s, {slot.get('n_prompt_tokens')} tokens in cache")
            proc.terminate()
            proc.wait(30)
        driver.close()
    return {
        "chat_tokens": chat_tokens,
        "restore_s": statistics.median(restore_s),
        "cold_s": statistics.median(cold_s),
        "ratio": statistics.median(restore_s) / statistics.median(cold_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--chat-tokens", type=int, default=1500)
    parser.add_argument("--only", choices=("decode", "threads"), help="one of the two measurements")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    parse_policy(bench_policy(), "bench policy")  # a policy the daemon would refuse fails here, not after a wait
    ladder_file = write_real_models(ROOT / "demo-models")
    ladder = load_ladder(ladder_file)
    print(f"llama-server: {find_program('llama-server')} ({os.cpu_count()} CPUs)")
    decode: dict[str, Any] = {}
    change: dict[str, Any] = {}
    if args.only in (None, "decode"):
        print("decode through the governor's socket vs llama-server alone (SmolLM2 Q8_0, 2 threads):")
        decode = through_the_governor(ladder_file, ladder, args.rounds, args.tokens)
        print(f"  median {decode['governed_tok_s']:.1f} / {decode['direct_tok_s']:.1f} tok/s; governed ÷ direct "
              f"{decode['ratio']:.3f} (goal >= 0.98); A/A control ÷ direct {decode['control_ratio']:.3f}")  # fmt: skip
    if args.only in (None, "threads"):
        print(f"threads 2 -> 1 on a {args.chat_tokens}-token chat: slot restore vs cold restart + prefill:")
        change = threads_change(ladder, max(2, args.rounds // 2), args.chat_tokens)
        print(f"  median restore {change['restore_s']:.2f} s, cold {change['cold_s']:.2f} s; restore ÷ cold "
              f"{change['ratio']:.3f} (goal <= 0.5)")  # fmt: skip
    if args.json:
        print(json.dumps({"decode": decode, "threads_change": change}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
