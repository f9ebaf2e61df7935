"""LoRA adapter files checked at engine start, and a request's adapter named in its `model` (no llama.cpp here: the
files are written with the `gguf` package; what llama.cpp makes of them is test_adapters.py's, in engine processes)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from governor.engine.adapters import MAX_ADAPTER_BYTES, inspect, split_model
from policies.ladder import LoraAdapter


def write_lora(
    path: Path, *, kind: str = "adapter", lora: str | None = "lora", arch: str = "llama", pairs: bool = True
) -> Path:
    """A LoRA GGUF as llama.cpp's convert_lora_to_gguf.py writes one: general.type adapter, adapter.type lora, A/B
    matrices per projection (rank 4 on a 64-wide model here)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(kind)
    if lora is not None:
        writer.add_string("adapter.type", lora)
    writer.add_float32("adapter.lora.alpha", 8.0)
    for layer in range(2):
        writer.add_tensor(f"blk.{layer}.attn_q.weight.lora_a", np.zeros((4, 64), dtype=np.float16))
        if pairs or layer == 0:
            writer.add_tensor(f"blk.{layer}.attn_q.weight.lora_b", np.zeros((64, 4), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def adapter(path: Path) -> LoraAdapter:
    return LoraAdapter(name="fr", path=path, base="medium")


def test_a_lora_file_is_sized_by_its_tensors(tmp_path: Path) -> None:
    spec = inspect(adapter(write_lora(tmp_path / "fr.gguf")))
    assert spec.error is None
    assert spec.arch == "llama"
    assert spec.bytes == 2 * 2 * (4 * 64 * 2)  # 2 layers x (A + B) x 256 f16 values


def _not_gguf(path: Path) -> Path:
    path.write_bytes(b"not a gguf at all")
    return path


BAD: dict[str, tuple[Callable[[Path], Path], str]] = {
    "missing": (lambda p: p, r"cannot read .*bad\.gguf: No such file"),
    "not gguf": (_not_gguf, r"is not a GGUF file"),
    "a model": (lambda p: write_lora(p, kind="model", lora=None), r"is not a LoRA adapter \(general.type 'model'"),
    "not lora": (lambda p: write_lora(p, lora="alora-x"), r"is not a LoRA adapter .*adapter.type 'alora-x'"),
    "lone A": (lambda p: write_lora(p, pairs=False), r"LoRA matrices missing their pair: \['blk.1.attn_q.weight'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_file_is_one_line_naming_what_is_wrong(tmp_path: Path, case: str) -> None:
    make, why = BAD[case]
    spec = inspect(adapter(make(tmp_path / "bad.gguf")))
    assert spec.error is not None
    assert "\n" not in spec.error
    assert re.search(why, spec.error), spec.error


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = write_lora(tmp_path / "fr.gguf")
    path.write_bytes(path.read_bytes()[:-300])
    spec = inspect(adapter(path))
    assert spec.error is not None, "a file whose tensors run past its end"


def test_a_file_too_large_for_a_lora_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.gguf"
    with path.open("wb") as f:
        f.truncate(MAX_ADAPTER_BYTES + 1)  # sparse: no disk used
    spec = inspect(adapter(path))
    assert spec.error is not None
    assert "a LoRA adapter is at most 2048" in spec.error


TIERS = {"large": 0, "medium": 0}
ADAPTERS = {"french": 0, "json": 0}


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (None, (None, None)),
        ("medium", ("medium", None)),
        ("medium:french", ("medium", "french")),
        ("large:json", ("large", "json")),
        ("french", (None, "french")),
    ],
)
def test_a_requests_model_names_a_tier_an_adapter_or_both(model: str | None, expected: tuple[str, str]) -> None:
    assert split_model(model, TIERS, ADAPTERS) == expected


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ("tiny:french", "unknown model tier 'tiny'"),
        ("medium:german", "unknown adapter 'german'"),
        ("x", "unknown model 'x'"),
    ],
)
def test_an_unknown_tier_or_adapter_is_named(model: str, why: str) -> None:
    with pytest.raises(KeyError, match=why):
        split_model(model, TIERS, ADAPTERS)
