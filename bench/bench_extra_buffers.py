"""Decode speed with llama.cpp's extra weight buffers on (repack) vs off, side by side in one run.

    .venv/bin/python bench/bench_extra_buffers.py [--rounds 5] [--tokens 64] [--threads 1]

`extra_buffers = auto` turns them off on AMX CPUs (governor.engine.extra_buffers); this measures what that costs where
both settings run: the engine's own model loader (`LoadedModel`), the same prompt, greedy, `--tokens` decoded tokens
after the prompt, on the real demo tiers (Q8_0, Q4_1, Q4_0) and the random demo-large (Q4_0, 150M). Rounds alternate
on/off so that load on the shared machine hits both alike; each figure is the median over rounds of decode tokens/s
(wall) and of CPU seconds per token (this process's, from os.times: robust to other processes taking the cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from governor.demo.models import RANDOM_DIR, write_demo_models
from governor.demo.smollm2 import REAL_TIERS, write_real_models
from governor.engine.config import single_model
from governor.engine.model import LoadedModel
from policies.decision import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


def decode(path: Path, extra_buffers: bool, tokens: int, threads: int) -> tuple[float, float, dict[str, float]]:
    """(decode tokens/s, CPU seconds per token, weight buffers) for one load of `path`."""
    spec = next(iter(single_model(path, 512).values()))
    model = LoadedModel(
        spec,
        EngineConfig(model=spec.name, n_ctx=512, kv_type="f16", threads=threads, max_tokens_per_s=None),
        extra_buffers=extra_buffers,
    )
    try:
        prompt = model.encode(model.render(PROMPT), prompt=True)
        gen = model.generate(prompt, {"temp": 0.0}, 1)
        next(gen)  # the prompt evaluation and the first token: not decode
        cpu0, t0 = _cpu(), time.perf_counter()
        for _ in range(tokens):
            next(gen)  # eos is not checked: Llama.generate goes on, a fixed amount of work per run
        wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
        gen.close()
        return tokens / wall, cpu / tokens, model.weight_buffers_mib
    finally:
        model.close()


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    real = write_real_models(ROOT / "demo-models").parent
    random_large = write_demo_models(ROOT / RANDOM_DIR).parent / "demo-large.gguf"
    models = {f"smollm2 {t.quant}": real / t.filename for t in REAL_TIERS} | {"random 150M q4_0": random_large}
    print(f"decode of {args.tokens} tokens, {args.threads} thread(s), median of {args.rounds} interleaved rounds")
    print(f"{'model':<18} {'on tok/s':>9} {'off tok/s':>9} {'off/on':>7} {'on ms CPU/tok':>14} {'off ms CPU/tok':>15}")
    print("  weights: on / off (MiB per llama.cpp buffer type)")
    for name, path in models.items():
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        buffers: dict[bool, dict[str, float]] = {}
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                tps, cpu, buffers[on] = decode(path, on, args.tokens, args.threads)
                runs[on].append((tps, cpu))
        med = {on: (statistics.median(t for t, _ in v), statistics.median(c for _, c in v)) for on, v in runs.items()}
        ratio = med[False][0] / med[True][0]
        print(
            f"{name:<18} {med[True][0]:9.1f} {med[False][0]:9.1f} {ratio:7.3f} "
            f"{med[True][1] * 1e3:14.2f} {med[False][1] * 1e3:15.2f}"
        )
        print(f"  weights: {buffers[True]} / {buffers[False]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
