"""What the engine runs: the models it may load, its current settings, and which changes are possible.

Everything here is checked before the running model is touched: a config the engine cannot build is refused
with a 4xx and the current model keeps serving.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from policies.decision import EngineConfig, KvType
from policies.ladder import ModelLadder

# GGML type ids as llama.cpp's `type_k` / `type_v` take them.
GGML_TYPE: dict[str, int] = {"f16": 1, "q8_0": 8, "q4_0": 2}
KV_TYPES: tuple[str, ...] = get_args(KvType)

Applied = Literal["live", "reload", "unloaded"]  # unloaded: recorded, used by the next load


class ConfigRefused(Exception):
    """A requested setting the engine cannot apply; `status` is the HTTP status the API answers."""

    def __init__(self, message: str, *, param: str | None, code: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


@dataclass(frozen=True)
class ModelSpec:
    """One loadable model: a ladder tier, or the single `--model PATH` (named after its file)."""

    name: str
    path: Path
    max_ctx: int | None  # the tier's largest context; None when not limited by a ladder
    default_ctx: int
    default_kv: KvType
    flash_attn: bool


def models_from_ladder(ladder: ModelLadder) -> dict[str, ModelSpec]:
    return {t.name: ModelSpec(t.name, t.path, t.n_ctx, t.n_ctx, t.kv_type, t.flash_attn) for t in ladder.tiers}


def single_model(path: Path, n_ctx: int) -> dict[str, ModelSpec]:
    return {path.stem: ModelSpec(path.stem, path.resolve(), None, n_ctx, "f16", True)}


# Head sizes by (file, mtime): learnt from every model the engine loads, read from the file otherwise.
_head_dims: dict[tuple[Path, int], int | None] = {}


def head_dim_from_metadata(meta: Mapping[str, str]) -> int | None:
    """The K head size from GGUF metadata as llama.cpp reports it (values as strings); None when not stated."""
    arch = meta.get("general.architecture")
    if not arch:
        return None
    try:
        key_length = meta.get(f"{arch}.attention.key_length")
        if key_length is not None:
            return int(key_length)
        embd, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    except (KeyError, ValueError):  # absent, or a per-layer array ("arr[i32,N]")
        return None
    return embd // heads if embd > 0 and heads > 0 else None


def learn_head_dim(path: Path, meta: Mapping[str, str]) -> None:
    """Called with a loaded model's metadata, so that checking its KV types never reads the file again."""
    with contextlib.suppress(OSError):
        _head_dims[(path, path.stat().st_mtime_ns)] = head_dim_from_metadata(meta)


def head_dim(path: Path) -> int | None:
    """The model's K head size, without loading its weights; None when the file does not say or cannot be read.

    Known at once for a model this process has loaded. Otherwise llama.cpp reads the file's metadata and vocabulary
    (`vocab_only`: about 0.5 s for a 49k-token vocabulary, in C, without the GIL), once per file version. Not on the
    event loop: see EngineApp.config.
    """
    try:
        key = (path, path.stat().st_mtime_ns)
    except OSError:
        return None
    if key not in _head_dims:
        from governor.engine.header import read_header  # llama.cpp: only where a file must be read

        header = read_header(path)
        _head_dims[key] = None if header is None else head_dim_from_metadata(header.meta)
    return _head_dims[key]


def resolve(current: EngineConfig, change: Mapping[str, Any], models: dict[str, ModelSpec]) -> EngineConfig:
    """The settings `change` (validated fields, see `EngineConfig.change`) asks for, or ConfigRefused naming the field
    that cannot be applied. Fields left out keep their values, except that a context larger than the new tier allows
    is clamped to it."""
    target = current.model_copy(update=change)
    spec = models.get(target.model)
    if spec is None:
        raise ConfigRefused(
            f"unknown model {target.model!r}; this engine has {sorted(models)}",
            param="model",
            code="model_not_found",
            status=404,
        )
    if spec.max_ctx is not None and target.n_ctx > spec.max_ctx:
        if "n_ctx" in change:
            raise ConfigRefused(
                f"n_ctx {target.n_ctx} exceeds model {spec.name!r}'s largest context {spec.max_ctx}",
                param="n_ctx",
                code="context_too_large",
            )
        target = target.model_copy(update={"n_ctx": spec.max_ctx})
    check_kv(spec, target.kv_type)
    if not spec.path.is_file():
        raise ConfigRefused(f"model file {spec.path} is missing", param="model", code="model_missing")
    return target


def check_kv(spec: ModelSpec, kv_type: str) -> None:
    """A quantized V cache needs flash attention and a head_dim divisible by 32 (else llama.cpp fails to build)."""
    if kv_type == "f16":
        return
    if not spec.flash_attn:
        raise ConfigRefused(
            f"kv_type {kv_type} needs flash attention, which model {spec.name!r} has switched off (flash_attn = false)",
            param="kv_type",
            code="unsupported_kv_type",
        )
    hd = head_dim(spec.path)
    if hd is None or hd % 32:
        raise ConfigRefused(
            f"kv_type {kv_type} needs a head_dim divisible by 32; model {spec.name!r} has head_dim {hd}",
            param="kv_type",
            code="unsupported_kv_type",
        )


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
