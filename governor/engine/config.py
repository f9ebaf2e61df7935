"""What the engine runs: the models it may load, its current settings, and which changes are possible.

Everything here is checked before the running model is touched: a config the engine cannot build is refused
with a 4xx and the current model keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from policies.decision import KvType, TokensPerS
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
    default_kv: str
    flash_attn: bool


@dataclass(frozen=True)
class Settings:
    """The settings in force; `POST /engine/config` changes a subset of them."""

    model: str
    n_ctx: int
    kv_type: str
    threads: int
    max_tokens_per_s: float | None

    def needs_reload(self, other: Settings) -> bool:
        return (self.model, self.n_ctx, self.kv_type) != (other.model, other.n_ctx, other.kv_type)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "n_ctx": self.n_ctx,
            "kv_type": self.kv_type,
            "threads": self.threads,
            "max_tokens_per_s": self.max_tokens_per_s,
        }


class ConfigChange(BaseModel):
    """The body of `POST /engine/config`: any subset of `policies.decision.EngineConfig`'s fields.

    `max_tokens_per_s: null` removes the cap, so "absent" and "null" differ: see `model_fields_set`.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    threads: int | None = Field(default=None, ge=1, le=256)
    n_ctx: int | None = Field(default=None, ge=64, le=1 << 20)
    kv_type: KvType | None = None
    model: str | None = Field(default=None, min_length=1, max_length=200)
    max_tokens_per_s: TokensPerS | None = None


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
        _head_dims[key] = head_dim_from_metadata(_file_metadata(path))
    return _head_dims[key]


def _file_metadata(path: Path) -> dict[str, str]:
    """The metadata `head_dim_from_metadata` needs, as llama.cpp reads it (only the vocabulary is loaded)."""
    import ctypes

    import llama_cpp

    # Without this llama.cpp logs the whole header to stderr; Llama(verbose=False) sets the same level.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return {}
    try:
        buf = ctypes.create_string_buffer(256)

        def get(key: str) -> str | None:
            n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
            return buf.value.decode(errors="replace") if 0 <= n < len(buf) else None

        arch = get("general.architecture")
        if arch is None:
            return {}
        keys = (f"{arch}.attention.key_length", f"{arch}.embedding_length", f"{arch}.attention.head_count")
        found = {k: get(k) for k in keys}
        return {"general.architecture": arch} | {k: v for k, v in found.items() if v is not None}
    finally:
        llama_cpp.llama_model_free(model)


def resolve(current: Settings, change: ConfigChange, models: dict[str, ModelSpec]) -> Settings:
    """The settings `change` asks for, or ConfigRefused naming the field that cannot be applied.

    Fields left out keep their values, except that a context larger than the new tier allows is clamped to it.
    """
    given = change.model_fields_set
    target = current
    if change.model is not None:
        if change.model not in models:
            raise ConfigRefused(
                f"unknown model {change.model!r}; this engine has {sorted(models)}",
                param="model",
                code="model_not_found",
                status=404,
            )
        target = replace(target, model=change.model)
    spec = models[target.model]
    if change.n_ctx is not None:
        if spec.max_ctx is not None and change.n_ctx > spec.max_ctx:
            raise ConfigRefused(
                f"n_ctx {change.n_ctx} exceeds model {spec.name!r}'s largest context {spec.max_ctx}",
                param="n_ctx",
                code="context_too_large",
            )
        target = replace(target, n_ctx=change.n_ctx)
    elif spec.max_ctx is not None and target.n_ctx > spec.max_ctx:
        target = replace(target, n_ctx=spec.max_ctx)
    if change.kv_type is not None:
        target = replace(target, kv_type=change.kv_type)
    if change.threads is not None:
        target = replace(target, threads=change.threads)
    if "max_tokens_per_s" in given:
        target = replace(target, max_tokens_per_s=change.max_tokens_per_s)
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
