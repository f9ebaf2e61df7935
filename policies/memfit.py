"""Memory fit: how much a model tier needs at a context length and KV type, and the largest setting that fits.

Footprints are read once from GGUF headers at start (I/O); `fit()` is pure arithmetic the state machine calls.
Estimate = weights (the file size) + KV cache + compute buffer (Ollama's estimate for llama-like graphs) + overhead,
plus the LoRA adapter pool when the ladder has adapters: the first thing to give way when memory is short.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govbase.errors import GovernorError
from policies.decision import KV_BYTES_PER_ELEMENT, KvType
from policies.schema import KV_ORDER, Memory

MIB = 1024 * 1024
QUANT_KV_HEAD_MULTIPLE = 32  # llama.cpp: a quantised V cache needs head_dim % 32 == 0 (and flash attention)


class MemFitError(GovernorError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    file_bytes: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int

    @classmethod
    def from_gguf(cls, path: Path) -> ModelFootprint:
        """Read with the `gguf` package (pure Python: seconds for a 49k-token vocabulary; the daemon reads its tiers
        with llama.cpp in a child instead, governor.daemon.footprints)."""
        from gguf import GGUFReader  # heavy import (numpy memmap); only replay, the lab and tests need it

        try:
            reader = GGUFReader(path)
        except (OSError, ValueError) as exc:
            raise MemFitError(path, f"cannot read GGUF header: {exc}") from exc

        def get(key: str) -> Any:
            field = reader.get_field(key)
            return None if field is None else field.contents()

        tokens = reader.get_field("tokenizer.ggml.tokens")
        return cls.from_fields(path, get, n_vocab=None if tokens is None else len(tokens.data))

    @classmethod
    def from_fields(cls, path: Path, get: Callable[[str], Any], *, n_vocab: int | None) -> ModelFootprint:
        """From GGUF header fields: `get(key)` gives an int, a numeric string, a per-layer list of ints or None."""

        def need(key: str) -> int:
            value = get(key)
            if value is None:
                raise MemFitError(path, f"GGUF header has no {key}")
            try:
                return int(max(value)) if isinstance(value, list) else int(value)  # per-layer arrays: the largest
            except (TypeError, ValueError):
                raise MemFitError(path, f"GGUF header field {key} is not a number: {str(value)[:40]!r}") from None

        arch = get("general.architecture")
        if not isinstance(arch, str):
            raise MemFitError(path, "GGUF header has no general.architecture")
        embd = need(f"{arch}.embedding_length")
        heads = need(f"{arch}.attention.head_count")
        kv_heads = need(f"{arch}.attention.head_count_kv") if get(f"{arch}.attention.head_count_kv") else heads
        key_len = need(f"{arch}.attention.key_length") if get(f"{arch}.attention.key_length") else embd // heads
        value_len = need(f"{arch}.attention.value_length") if get(f"{arch}.attention.value_length") else key_len
        try:
            file_bytes = path.stat().st_size
        except OSError as exc:
            raise MemFitError(path, f"cannot read GGUF header: {exc}") from exc
        return cls(
            file_bytes=file_bytes,
            n_layer=need(f"{arch}.block_count"),
            n_embd=embd,
            n_head=heads,
            n_head_kv=kv_heads,
            head_dim_k=key_len,
            head_dim_v=value_len,
            n_vocab=n_vocab if n_vocab is not None else need(f"{arch}.vocab_size"),
        )

    def kv_bytes(self, n_ctx: int, kv_type: KvType) -> float:
        per_element = KV_BYTES_PER_ELEMENT[kv_type]
        return n_ctx * (self.head_dim_k + self.head_dim_v) * self.n_head_kv * self.n_layer * per_element

    def compute_bytes(self, n_ctx: int, n_batch: int) -> float:
        """Ollama's graph estimate for llama-like models: max(4b(1+4E+C(1+H)), 4b(E+V)), one sequence."""
        b = min(n_ctx, n_batch)
        return float(
            max(4 * b * (1 + 4 * self.n_embd + n_ctx * (1 + self.n_head)), 4 * b * (self.n_embd + self.n_vocab))
        )

    def total_bytes(self, n_ctx: int, kv_type: KvType, memory: Memory, n_batch: int | None = None) -> float:
        return (
            self.file_bytes
            + self.kv_bytes(n_ctx, kv_type)
            + self.compute_bytes(n_ctx, memory.n_batch if n_batch is None else n_batch)
            + memory.overhead_mb * MIB
        )

    @property
    def quantized_kv_ok(self) -> bool:
        return self.head_dim_k % QUANT_KV_HEAD_MULTIPLE == 0 and self.head_dim_v % QUANT_KV_HEAD_MULTIPLE == 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """A model tier the profile allows, with what the engine can do with it."""

    name: str
    footprint: ModelFootprint
    max_ctx: int  # the tier's own largest context (ladder)
    flash_attn: bool


@dataclass(frozen=True, slots=True)
class Fit:
    model: str
    n_ctx: int
    kv_type: KvType
    bytes: float
    bound: str  # "profile" (the state's limits), "memory" (shrunk to fit), "nothing fits" (smallest possible)
    note: str = ""  # a forced KV fallback, said in the reason
    budget_bytes: float | None = None  # what it had to fit in (None: memory unknown)
    n_batch: int | None = None  # lowered below the policy's memory.n_batch to fit (None: not lowered)
    held: str | None = None  # the engine in force is about to be killed for what it holds now: why it stops
    pool_bytes: float = 0.0  # the LoRA adapter pool it leaves the engine (counted in `bytes`)
    kill: str | None = None  # a model switch sooner than the model dwell: why the model in force would be killed

    @property
    def wait(self) -> str | None:
        """When nothing fits: why the engine must not run now (starting it would only meet the OOM killer)."""
        if self.held is not None:
            return self.held
        if self.bound != "nothing fits" or self.budget_bytes is None:
            return None
        return f"no tier fits in {max(0.0, self.budget_bytes) / MIB:.0f} MiB; waiting for memory"


def kv_options(kv_type: KvType, memory: Memory) -> tuple[KvType, ...]:
    i = KV_ORDER.index(kv_type)
    return KV_ORDER[i:] if memory.kv_fallback else (kv_type,)


def largest_ctx(
    fp: ModelFootprint, kv_type: KvType, *, lo: int, hi: int, budget: float, memory: Memory, n_batch: int | None = None
) -> int | None:
    """The largest context in [lo, hi] (hi itself, else a multiple of ctx_multiple) whose footprint fits, or None."""
    if fp.total_bytes(hi, kv_type, memory, n_batch) <= budget:
        return hi
    if fp.total_bytes(lo, kv_type, memory, n_batch) > budget:
        return None
    step = memory.ctx_multiple
    k_lo, k_hi = -(-lo // step), (hi - 1) // step  # multiples strictly inside (lo, hi)
    best = lo
    while k_lo <= k_hi:  # total_bytes grows with n_ctx, so bisect
        k = (k_lo + k_hi) // 2
        if fp.total_bytes(k * step, kv_type, memory, n_batch) <= budget:
            best, k_lo = max(best, k * step), k + 1
        else:
            k_hi = k - 1
    return best


def fit(
    candidates: Sequence[Candidate],
    *,
    max_ctx: int,
    kv_type: KvType,
    budget_bytes: float | None,
    memory: Memory,
    adapters: bool = False,
) -> Fit:
    """The first tier (largest first) with some context >= min_ctx that fits; within a tier, the KV type giving the
    largest context (ties: the more precise). With no budget (memory unknown) the profile's limits stand.

    With `adapters` (the ladder has LoRA adapters) the engine's adapter pool counts too, `memory.lora_pool_mib`
    when there is room; short of room it shrinks first (to `min_lora_pool_mib`), before KV type, context or tier:
    a smaller pool costs an adapter reload now and then, a smaller context or tier every answer."""
    assert candidates, "fit() needs at least one tier"
    pool_max = memory.lora_pool_mib * MIB if adapters else 0.0
    pool_min = min(pool_max, memory.min_lora_pool_mib * MIB)
    last: Fit | None = None
    for i, cand in enumerate(candidates):
        fp, hi = cand.footprint, min(max_ctx, cand.max_ctx)
        lo = min(memory.min_ctx, hi)
        options, note = kv_options(kv_type, memory), ""
        if kv_type != "f16" and not (cand.flash_attn and fp.quantized_kv_ok):
            options = ("f16",)
            note = (
                f"{kv_type} KV needs flash attention and head_dim % {QUANT_KV_HEAD_MULTIPLE} == 0 "
                f"({cand.name}: head_dim {fp.head_dim_k}/{fp.head_dim_v}, flash_attn {cand.flash_attn}), using f16"
            )
        top = fp.total_bytes(hi, options[0], memory)
        if budget_bytes is None:
            return Fit(cand.name, hi, options[0], top + pool_max, "profile", note, pool_bytes=pool_max)
        if top + pool_min <= budget_bytes:  # the profile's setting fits, the pool giving way if it must
            pool = max(pool_min, min(pool_max, math.floor((budget_bytes - top) / MIB) * MIB))
            bound = "profile" if i == 0 and pool == pool_max else "memory"
            return Fit(cand.name, hi, options[0], top + pool, bound, note, budget_bytes, pool_bytes=pool)
        budget = budget_bytes - pool_min  # the pool at its smallest; now the KV type, context, n_batch, tier
        best: tuple[int, KvType] | None = None
        for kv in options:
            ctx = largest_ctx(fp, kv, lo=lo, hi=hi, budget=budget, memory=memory)
            if ctx is not None and (best is None or ctx > best[0]):
                best = (ctx, kv)
        if best is not None:
            ctx, kv = best
            size = fp.total_bytes(ctx, kv, memory) + pool_min
            return Fit(cand.name, ctx, kv, size, "memory", note, budget_bytes, pool_bytes=pool_min)
        # The tier's smallest context and KV type do not fit: a smaller n_batch shrinks the compute buffer (a peak
        # allocation, linear in n_batch) at some prompt speed, before a smaller tier costs answer quality.
        kv, n_batch = options[-1], memory.n_batch // 2
        while n_batch >= memory.min_n_batch:
            ctx = largest_ctx(fp, kv, lo=lo, hi=hi, budget=budget, memory=memory, n_batch=n_batch)
            if ctx is not None:
                size = fp.total_bytes(ctx, kv, memory, n_batch) + pool_min
                return Fit(cand.name, ctx, kv, size, "memory", note, budget_bytes, n_batch, pool_bytes=pool_min)
            n_batch //= 2
        size = fp.total_bytes(lo, options[-1], memory) + pool_min
        last = Fit(cand.name, lo, options[-1], size, "nothing fits", note, budget_bytes, pool_bytes=pool_min)
    assert last is not None
    return last
