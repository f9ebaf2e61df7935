"""Engine memory benchmark: RSS after swapping to a smaller model ÷ a cold start on it (goal <= 1.1).

    .venv/bin/python bench/bench_engine_memory.py [--runs 5] [--quick]

The engine's RSS (its own GET /engine/status) after large -> small and an answer, against an engine started on small
that answered the same; and the same in-process (`Llama.close()` then load small, in a fresh process, against small
alone). Large is the demo ladder's large model and (not with --quick) a larger random model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_common import BIG, SAMPLING, demo_ladder, median, our_engine, ratio_line, served
from governor.demo import models as demo
from policies.ladder import load_ladder

INPROC_RSS = """
import json, sys, psutil
from governor.engine.model import open_llama
def run(path):
    llm = open_llama(path, n_ctx=2048, n_threads=2, flash_attn=True, verbose=False)
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
    with served(our_engine(sock, *args), sock) as server:
        client = server.client
        client.chat(hello, model=client.status().model, max_tokens=16, **SAMPLING)
        before = client.status().rss_bytes or 0
        if switch_to is not None:
            client.configure(model=switch_to)
            client.chat(hello, model=switch_to, max_tokens=16, **SAMPLING)
        return before, client.status().rss_bytes or 0


def bench_memory(ladder: Path, big_ladder: Path | None, args: argparse.Namespace, tmp: Path) -> None:
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
    parser.add_argument("--runs", type=int, default=5, help="repetitions (median reported)")
    parser.add_argument("--quick", action="store_true", help="skip the larger random model")
    args, _ = parser.parse_known_args()  # run_all.py passes every script the same arguments
    ladder = demo_ladder()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as d:
        tmp = Path(d)
        big_ladder = None
        if not args.quick:
            t0 = time.perf_counter()
            demo.write_model(BIG, tmp / BIG.filename)
            print(f"wrote {BIG.filename} ({BIG.n_params / 1e6:.0f}M params) in {time.perf_counter() - t0:.1f} s")
            big_ladder = tmp / "big-ladder.toml"
            small = ladder.parent / "demo-small.gguf"
            big_ladder.write_text(
                f'[[tier]]\nname = "large"\npath = "{BIG.filename}"\n\n'
                f'[[tier]]\nname = "small"\npath = "{small}"\nkv_type = "q8_0"\n'
            )
        bench_memory(ladder, big_ladder, args, tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
