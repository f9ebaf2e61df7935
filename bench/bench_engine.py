"""Engine benchmark: our engine against llama.cpp in-process and against `llama_cpp.server`, side by side in one run.

    .venv/bin/python bench/bench_engine.py [--runs 5] [--tokens 128] [--quick]

Prints, each as the median of `--runs` interleaved repetitions (the machine is shared: figures are noisy):
- decode tokens/s of the same model, prompt and settings (greedy, fixed max_tokens) streamed through our engine's
  socket ÷ in-process `Llama.create_chat_completion(stream=True)` (goal >= 0.97) and ÷ `llama_cpp.server` (uvicorn on a
  Unix socket) with the same client (goal >= 1.0); on the demo large model and on a larger random model;
- each kind of reconfiguration applied mid-stream (POST /engine/config) ÷ (cold load of the target + re-prefill of the
  same conversation, in-process) (goal <= 1.2);
- the engine's RSS after large -> small ÷ a cold engine on small (goal <= 1.1), and the same for in-process `close()`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from governor.engine import demo
from governor.engine.client import EngineClient

ROOT = Path(__file__).resolve().parent.parent
GGML_TYPE = {"f16": 1, "q8_0": 8, "q4_0": 2}
# A larger random model (about 450M parameters, 250 MB in Q4_0) whose decode is slow enough to measure server overhead.
BIG = demo.DemoModel("big", n_embd=1536, n_layer=16, n_ff=4096, n_head_kv=12, quant="q4_0", kv_type="f16", seed=4)
SAMPLING: dict[str, Any] = {"temperature": 0.0, "repeat_penalty": 1.0, "top_p": 1.0}
Messages = list[dict[str, str]]


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


def measure_stream(chunks: Iterable[Mapping[str, Any]], tokens: int) -> Run:
    """Decode rate as the client sees it: the tokens after the first ÷ the time from the first text to the final chunk.

    Counted in tokens (`tokens`, the max_tokens every run reaches), not chunks: servers differ in how they hold
    back and emit the partial UTF-8 bytes a random model produces.
    """
    t0 = time.perf_counter()
    first = end = 0.0
    n = 0
    finish = None
    for chunk in chunks:
        now = time.perf_counter()
        choices = chunk.get("choices") or [{}]
        if choices[0].get("delta", {}).get("content"):
            first = first or now
            n += 1
        if choices[0].get("finish_reason"):
            finish, end = choices[0]["finish_reason"], now
    return Run((tokens - 1) / (end - first) if end > first else 0.0, first - t0, n, finish)


@contextlib.contextmanager
def served(cmd: list[str], sock: Path, env: Mapping[str, str] | None = None) -> Iterator[EngineClient]:
    """A server process on a Unix socket, ready; stopped (SIGTERM, then SIGKILL) on exit."""
    with tempfile.TemporaryFile() as log, EngineClient(sock, timeout_s=30) as client:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + 180
            while not _answers(client):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"{cmd[:4]} did not come up (exit {proc.poll()}):\n{tail}")
                time.sleep(0.1)
            yield client
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(client: EngineClient) -> bool:
    try:
        client.models()
    except Exception:  # any failure means "not up yet"; the caller watches the process
        return False
    return True


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
    return llama_cpp.Llama(
        model_path=str(path),
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


# -- decode ------------------------------------------------------------------------------------------------------


def bench_decode(path: Path, name: str, threads: int, args: argparse.Namespace, tmp: Path) -> None:
    messages = conversation(1)
    body = {"max_tokens": args.tokens, **SAMPLING}
    n_ctx = 2048
    sides: dict[str, Callable[[], Run]] = {}
    with contextlib.ExitStack() as stack:
        llm = load(path, n_ctx, threads)
        stack.callback(llm.close)
        sides["in-process"] = lambda: measure_stream(
            llm.create_chat_completion(messages=messages, stream=True, **body),  # type: ignore[arg-type]
            args.tokens,
        )
        model = path.stem
        try:
            ours = stack.enter_context(
                served(
                    our_engine(tmp / "ours.sock", "--model", str(path), "--ctx", str(n_ctx), "--threads", str(threads)),
                    tmp / "ours.sock",
                )
            )
            sides["ours"] = lambda: measure_stream(ours.stream_chat(messages, model=model, **body), args.tokens)
        except RuntimeError as exc:
            print(f"  our engine is not available, measuring the others only: {exc}")
        peer = stack.enter_context(
            served(llama_cpp_server(tmp / "peer.sock"), tmp / "peer.sock", llama_cpp_server_env(path, n_ctx, threads))
        )
        sides["llama_cpp.server"] = lambda: measure_stream(peer.stream_chat(messages, model=model, **body), args.tokens)
        for side in sides.values():  # warm up: page in the weights, fill each side's prompt cache
            side()
        runs: dict[str, list[Run]] = {k: [] for k in sides}
        for _ in range(args.runs):
            for k, side in sides.items():
                runs[k].append(side())
    print(f"\ndecode, {name}: {args.tokens} tokens, greedy, {threads} threads, n_ctx {n_ctx}, median of {args.runs}")
    for k, rs in runs.items():
        each = sorted(r.decode_tps for r in rs)
        finishes = sorted({str(r.finish) for r in rs})
        print(
            f"  {k:<18} {median(each):8.1f} tok/s  (min {each[0]:.1f}, max {each[-1]:.1f}; "
            f"chunks {median(r.chunks for r in rs):.0f}, finish {','.join(finishes)})"
        )

    def paired(a: str, b: str, goal: str) -> None:
        """The median of per-round ratios: each round's sides ran back to back, so slow drift cancels."""
        ratios = [x.decode_tps / y.decode_tps for x, y in zip(runs[a], runs[b], strict=True) if y.decode_tps]
        print(
            f"  {a + ' ÷ ' + b:<46} {median(ratios):6.3f}   (goal {goal}; rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )

    if "ours" in runs:
        paired("ours", "in-process", ">= 0.97")
        paired("ours", "llama_cpp.server", ">= 1.0")
    paired("llama_cpp.server", "in-process", "-")


# -- reconfiguration ---------------------------------------------------------------------------------------------

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


def switch_mid_stream(client: EngineClient, messages: Messages, change: dict[str, Any], after: int) -> Switch:
    text: list[str] = []
    stamps: list[float] = []
    reached = threading.Event()
    outcome: dict[str, Any] = {}

    def consume() -> None:
        try:
            for chunk in client.stream_chat(messages, model="large", max_tokens=after + 48, **SAMPLING):
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


def cold_baseline(ladder: Path, settings: Mapping[str, Any], messages: Messages, answer: str) -> float:
    """In-process: load the target model with the target settings and evaluate the same conversation."""
    from policies.ladder import load_ladder

    tier = load_ladder(ladder).get(settings["model"])
    t0 = time.perf_counter()
    llm = load(tier.path, settings["n_ctx"], settings["threads"], settings["kv_type"])
    try:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        # The same rendering as the engines: the model's own template.
        fmt = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token="<|im_end|>", bos_token="<s>")
        prompt = fmt(messages=messages).prompt  # type: ignore[arg-type]
        tokens = llm.tokenize(prompt.encode(), special=True)
        tokens += llm.tokenize(answer.encode(), add_bos=False)
        llm.eval(tokens)
        return time.perf_counter() - t0
    finally:
        llm.close()


def bench_reconfig(ladder: Path, args: argparse.Namespace, tmp: Path) -> None:
    messages = conversation(3)  # about 750 tokens: fits n_ctx 1024 with room for the answer, so nothing is trimmed
    sock = tmp / "reconf.sock"
    rows: dict[str, list[tuple[Switch, float]]] = {}
    with served(our_engine(sock, "--models", str(ladder), "--threads", "2"), sock) as client:
        for _ in range(args.runs):
            for kind, change in CHANGES:
                sw = switch_mid_stream(client, messages, change, after=32)
                settings = client.status().model_dump()
                base = cold_baseline(ladder, settings, messages, sw.generated)
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


# -- memory ------------------------------------------------------------------------------------------------------

INPROC_RSS = """
import json, sys, psutil, llama_cpp
def run(path):
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=2, flash_attn=True, verbose=False)
    llm.create_completion("the people of the world", max_tokens=16, temperature=0.0)
    return llm
paths = sys.argv[1:]
for p in paths[:-1]:
    run(p).close()
llm = run(paths[-1])
print(json.dumps(psutil.Process().memory_info().rss))
"""


def inproc_rss(*paths: Path) -> int:
    out = subprocess.run(
        [sys.executable, "-c", INPROC_RSS, *map(str, paths)], check=True, capture_output=True, text=True
    ).stdout
    return int(json.loads(out.strip().splitlines()[-1]))


def engine_rss(ladder: Path, tmp: Path, switch_to: str | None, start_tier: str | None = None) -> tuple[int, int]:
    """The engine's RSS (as GET /engine/status reports it) after an answer, and again after switching and answering."""
    sock = tmp / "rss.sock"
    args = ["--models", str(ladder), "--threads", "2"] + (["--tier", start_tier] if start_tier else [])
    hello = [{"role": "user", "content": "hello"}]
    with served(our_engine(sock, *args), sock) as client:
        client.chat(hello, model=client.status().model, max_tokens=16, **SAMPLING)
        before = client.status().rss_bytes or 0
        if switch_to is not None:
            client.configure(model=switch_to)
            client.chat(hello, model=switch_to, max_tokens=16, **SAMPLING)
        return before, client.status().rss_bytes or 0


def bench_memory(ladder: Path, big_ladder: Path | None, args: argparse.Namespace, tmp: Path) -> None:
    from policies.ladder import load_ladder

    print(f"\nmemory: RSS after large -> small ÷ small cold, median of {args.runs}")
    mb = 1 << 20
    for name, lad in [("demo large", ladder)] + ([(BIG.name, big_ladder)] if big_ladder else []):
        tiers = load_ladder(lad)
        large, small = tiers.tiers[0].path, tiers.get("small").path
        on_large, swapped, cold, in_swapped, in_cold = [], [], [], [], []
        for _ in range(args.runs):
            before, after = engine_rss(lad, tmp, "small")
            on_large.append(before)
            swapped.append(after)
            cold.append(engine_rss(lad, tmp, None, start_tier="small")[1])
            in_swapped.append(inproc_rss(large, small))
            in_cold.append(inproc_rss(small))
        print(
            f"  {name} -> demo small: engine {median(on_large) / mb:.0f} MB on large, {median(swapped) / mb:.0f} MB "
            f"after the swap, {median(cold) / mb:.0f} MB started on small; in-process Llama.close() then small: "
            f"{median(in_swapped) / mb:.0f} MB vs {median(in_cold) / mb:.0f} MB small alone"
        )
        print(ratio_line(f"engine after the swap ÷ cold ({name})", median(swapped), median(cold), "<= 1.1"))
        print(ratio_line(f"in-process close() ÷ cold ({name})", median(in_swapped), median(in_cold), "-"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="interleaved repetitions per figure (median reported)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens to decode per run")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[1, 2], help="compute threads of the decode comparison (each)"
    )
    parser.add_argument("--quick", action="store_true", help="skip the larger random model")
    parser.add_argument("--only", choices=["decode", "reconfig", "memory"], help="run one part")
    args = parser.parse_args()
    print("Figures are medians of interleaved runs on a shared machine: noisy, compare the ratios, not the speeds.")
    ladder = demo.write_demo_models(Path(os.environ.get("GOVERNOR_DEMO_DIR") or ROOT / demo.RANDOM_DIR))
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as d:
        tmp = Path(d)
        big_ladder = None
        if not args.quick:
            t0 = time.perf_counter()
            demo.write_model(BIG, tmp / BIG.filename)
            print(
                f"wrote {BIG.filename} ({BIG.n_params / 1e6:.0f}M params, {BIG.quant}) in "
                f"{time.perf_counter() - t0:.1f} s"
            )
            big_ladder = tmp / "big-ladder.toml"
            small = ladder.parent / "demo-small.gguf"
            big_ladder.write_text(
                f'[[tier]]\nname = "large"\npath = "{BIG.filename}"\n\n'
                f'[[tier]]\nname = "small"\npath = "{small}"\nkv_type = "q8_0"\n'
            )
        if args.only in (None, "decode"):
            models = [(ladder.parent / "demo-large.gguf", "demo-large (150M, Q4_0)")]
            if not args.quick:
                models.append((tmp / BIG.filename, f"{BIG.name} ({BIG.n_params / 1e6:.0f}M, Q4_0)"))
            for path, name in models:
                for threads in args.threads:
                    bench_decode(path, name, threads, args, tmp)
        if args.only in (None, "reconfig"):
            bench_reconfig(ladder, args, tmp)
        if args.only in (None, "memory"):
            bench_memory(ladder, big_ladder, args, tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
