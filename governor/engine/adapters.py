"""LoRA adapters per request, from a pool of fixed size (issue 32).

One base model stays loaded; each task is a small LoRA adapter file (the ladder's `[[adapter]]` entries). A request
names one (`"model": "TIER:ADAPTER"` or `"governor": {"adapter": NAME}`); the engine loads it into llama.cpp
(`llama_adapter_lora_init`: its A/B matrices, copied from the file into a CPU buffer) and sets it on the context
(`llama_set_adapters_lora`). The adapters in memory are a pool with a byte budget (`lora_pool_mib`, an engine
setting the policy turns): least recently used ones are freed to make room, so the pool's memory stays bounded
however many adapters the ladder names.

The KV cache belongs to the adapter that computed it: LoRA changes the projections, so a prefix computed with
adapter A means something else under B. Switching adapters therefore never keeps the cache; the outgoing adapter's
cache is parked in the pool's spare room (`llama_state_seq_get_data`), and put back when that adapter is next
used, so alternating clients each keep their prefix. llama.cpp's own server does the first half: it clears a
slot's prompt cache when its LoRA set changes.

Only the worker thread calls llama.cpp here: `llama_adapter_lora_init` inserts into the model's adapter set, which
a decode that re-reserves its graph reads. What may run beside a decode is a page-cache read-ahead of a file the
queue will need (`readahead`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from governor.engine.adapterspec import AdapterError, AdapterSpec
from policies.ladder import LoraAdapter

if TYPE_CHECKING:
    from governor.engine.model import LoadedModel

log = structlog.get_logger("governor.engine")

MIB = 1 << 20
MAX_ADAPTER_BYTES = 2 << 30  # a LoRA file larger than this is not one a device pool is for


def inspect(adapter: LoraAdapter) -> AdapterSpec:
    """Read `adapter`'s GGUF header (the `gguf` package: a few ms for a LoRA file, which has no vocabulary) and check
    what llama.cpp's loader would refuse, so that a bad file is one line at start, not a failed request later."""
    spec = AdapterSpec(adapter.name, adapter.path, adapter.base, adapter.scale, 0, None)
    try:
        size = adapter.path.stat().st_size
    except OSError as exc:
        return _bad(spec, f"cannot read {adapter.path}: {exc.strerror}")
    if size > MAX_ADAPTER_BYTES:
        return _bad(
            spec, f"{adapter.path} is {size / MIB:.0f} MiB; a LoRA adapter is at most {MAX_ADAPTER_BYTES >> 20}"
        )
    from gguf import GGUFReader  # only where a ladder names adapters

    try:
        reader = GGUFReader(adapter.path)
    except (OSError, ValueError, IndexError, KeyError) as exc:  # what a truncated or foreign file raises in it
        return _bad(spec, f"{adapter.path} is not a GGUF file: {type(exc).__name__}: {exc}")

    def text(key: str) -> str | None:
        got = reader.get_field(key)
        value = None if got is None else got.contents()
        return value if isinstance(value, str) else None

    if text("general.type") != "adapter" or text("adapter.type") != "lora":
        kind = f"general.type {text('general.type')!r}, adapter.type {text('adapter.type')!r}"
        return _bad(spec, f"{adapter.path} is not a LoRA adapter ({kind}; a model file?)")
    arch = text("general.architecture")
    if arch is None:
        return _bad(spec, f"{adapter.path} names no general.architecture")
    pairs: dict[str, set[str]] = {}
    total = 0
    for t in reader.tensors:
        stem, _, part = t.name.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            if t.name.endswith("_norm.weight"):  # llama.cpp skips these too
                continue
            return _bad(spec, f"{adapter.path}: tensor {t.name!r} is not a LoRA A/B matrix")
        pairs.setdefault(stem, set()).add(part)
        total += int(t.n_bytes)
    lone = sorted(stem for stem, parts in pairs.items() if len(parts) != 2)
    if not pairs or lone:
        return _bad(spec, f"{adapter.path}: LoRA matrices missing their pair: {lone[:3]}" if lone else "no tensors")
    return AdapterSpec(adapter.name, adapter.path, adapter.base, adapter.scale, total, arch)


def _bad(spec: AdapterSpec, why: str) -> AdapterSpec:
    return AdapterSpec(spec.name, spec.path, spec.base, spec.scale, spec.bytes, spec.arch, why)


def inspect_all(adapters: Sequence[LoraAdapter]) -> dict[str, AdapterSpec]:
    specs = {a.name: inspect(a) for a in adapters}
    for s in specs.values():
        if s.error is not None:
            log.error("engine.adapter_invalid", adapter=s.name, error=s.error)
    return specs


def split_model(
    model: str | None, tiers: Mapping[str, object], adapters: Mapping[str, object]
) -> tuple[str | None, str | None]:
    """A request's `model` as (tier, adapter): "TIER", "TIER:ADAPTER" or "ADAPTER"; KeyError naming what is
    unknown. The tier is the client's wish only: the governor picks the tier that runs (the answer says which)."""
    if model is None or model in tiers:
        return model, None
    tier, sep, name = model.rpartition(":")
    if not sep:
        if model not in adapters:  # neither a tier nor an adapter
            known = list(tiers) + [f"{a} (adapter)" for a in adapters]
            raise KeyError(f"unknown model {model!r}; this engine serves {known}")
        tier, name = "", model
    if tier and tier not in tiers:
        raise KeyError(f"unknown model tier {tier!r}; this engine serves {list(tiers)}")
    if name not in adapters:
        raise KeyError(f"unknown adapter {name!r}; this engine has {list(adapters) or 'none'}")
    return tier or None, name


def readahead(path: Path) -> None:
    """Ask the kernel to read `path` into the page cache now (asynchronously), so that loading it later is a copy
    from memory rather than a wait for storage. Safe beside a decode: no llama.cpp call."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class PoolCounters:
    hits: int = 0  # a request's adapter was in the pool already (the last answer's, or a switch to a loaded one)
    misses: int = 0  # ... it had to be read from its file
    evictions: int = 0  # adapters freed to make room
    switches: int = 0  # the context's adapter changed (the KV cache with it)
    parked_reused: int = 0  # a switch put back the cache the incoming adapter left
    prefetches: int = 0  # adapters loaded ahead of the request that needs them
    load_failures: int = 0
    load_s_total: float = 0.0


@dataclass
class Carried:
    """What a new model (a reload, a tier change) kept of the adapters the old one had loaded."""

    kept: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)  # name -> why

    def as_dict(self) -> dict[str, Any]:
        return {"kept": self.kept, "dropped": self.dropped}


class AdapterPool:
    """The loaded adapters of the current model within `budget_bytes`, least recently used first out, and the
    parked KV caches of adapters switched away from in what room they leave. Worker thread only."""

    def __init__(self, specs: dict[str, AdapterSpec], budget_mib: float) -> None:
        self.specs = specs  # shared with the worker: an adapter found not to match its base tier is marked here
        self.budget_bytes = int(budget_mib * MIB)
        self.counters = PoolCounters()
        self.last_carry: Carried | None = None
        self._carry: tuple[list[str], str | None] | None = None  # (loaded, active) of a model closed for a reload

    # --- state, for status (read from the event loop: plain values) ---

    def used_bytes(self, m: LoadedModel | None, *, parked: bool = True) -> int:
        if m is None:
            return 0
        held = sum(self.specs[n].bytes for n in list(m.adapters))  # list(): one step, the loop may read it
        return held + (sum(s.size for s in list(m.parked.values())) if parked else 0)

    def status(self, m: LoadedModel | None) -> dict[str, Any]:
        loaded = [] if m is None else list(m.adapters)
        parked = {} if m is None else dict(m.parked)
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes(m),
            "loaded": loaded,  # least recently used first
            "active": None if m is None else m.adapter,
            "parked": {("" if k is None else k): len(v.tokens) for k, v in parked.items()},
            **vars(self.counters),
        }

    # --- the worker's calls ---

    def use(self, m: LoadedModel, name: str | None) -> None:
        """Make `name` (None: the base model alone) the adapter of `m`'s context, loading it if needed; the KV cache
        follows (parked for the outgoing adapter, the incoming one's put back). AdapterError when it cannot."""
        if name is not None:
            self._ensure(m, name)
            m.adapters.move_to_end(name)
        if m.adapter == name:
            return
        outgoing = m.adapter
        # Parked only if it can fit beside the adapters (other parked caches go first): the copy is not free.
        room = self.budget_bytes - self.used_bytes(m, parked=False)
        saved = m.save_sequence() if 0 < m.sequence_bytes() <= room else None
        m.clear_cache()
        m.set_adapter(name, None if name is None else self.specs[name].scale)
        self.counters.switches += 1
        if saved is not None:
            self._park(m, outgoing, saved)
        back = m.parked.pop(name, None)
        if back is not None and m.restore_sequence(back):
            self.counters.parked_reused += 1
        log.info("engine.adapter_switch", frm=outgoing, to=name, parked=saved is not None, reused=back is not None)

    def _ensure(self, m: LoadedModel, name: str) -> None:
        spec = self.specs[name]
        if spec.error is not None:
            raise AdapterError(f"adapter {name!r} cannot be used: {spec.error}", status=500, code="adapter_invalid")
        if name in m.adapters:
            self.counters.hits += 1
            return
        self._make_room(m, name)
        t0 = time.perf_counter()
        try:
            m.load_adapter(spec)
        except AdapterError:
            self.counters.load_failures += 1
            raise
        seconds = time.perf_counter() - t0
        self.counters.misses += 1
        self.counters.load_s_total += seconds
        log.info("engine.adapter_loaded", adapter=name, tier=m.spec.name, bytes=spec.bytes, seconds=round(seconds, 4))

    def _make_room(self, m: LoadedModel, name: str) -> None:
        """Room for adapter `name`: parked caches go first, then the least recently used adapters other than the
        one in use, then (between answers) that one too; AdapterError when it is larger than the whole pool."""
        need = self.specs[name].bytes
        if need > self.budget_bytes:
            raise AdapterError(
                f"adapter {name!r} needs {need / MIB:.1f} MiB; the LoRA pool holds {self.budget_bytes / MIB:.1f} "
                "MiB (lora_pool_mib: the governor shrinks it when memory is short)",
                status=503,
                code="adapter_pool_full",
            )
        if not self._evict(m, need) and m.adapter is not None:
            self.use(m, None)  # the adapter of the last answer alone fills it
            self._evict(m, need)

    def _evict(self, m: LoadedModel, need: int) -> bool:
        """Free parked caches, then least recently used adapters other than the active one, until `need` more bytes
        fit the budget; whether they do."""
        while self.used_bytes(m) + need > self.budget_bytes and m.parked:
            m.parked.popitem(last=False)
        for victim in list(m.adapters):
            if self.used_bytes(m) + need <= self.budget_bytes:
                break
            if victim != m.adapter:
                m.free_adapter(victim)
                self.counters.evictions += 1
                log.info("engine.adapter_evicted", adapter=victim, budget_bytes=self.budget_bytes)
        return self.used_bytes(m) + need <= self.budget_bytes

    def _park(self, m: LoadedModel, owner: str | None, saved: Any) -> None:
        room = self.budget_bytes - self.used_bytes(m)
        while m.parked and saved.size > room:
            _, dropped = m.parked.popitem(last=False)
            room += dropped.size
        if saved.size <= room:
            m.parked[owner] = saved

    def resize(self, m: LoadedModel | None, budget_mib: float, *, answering: bool) -> None:
        """A new budget (a live setting): evict down to it now; the adapter in use too when no answer runs on it
        (else it goes when its answer has ended and the next one needs room)."""
        self.budget_bytes = int(budget_mib * MIB)
        if m is None:
            return
        if not answering and m.adapter is not None and self.used_bytes(m, parked=False) > self.budget_bytes:
            self.use(m, None)
        self._evict(m, 0)

    def prefetch(self, m: LoadedModel, name: str) -> bool:
        """Load `name` ahead of the request that will use it (called between two tokens of another answer), when
        it fits without freeing the adapter in use. True when it is loaded now."""
        spec = self.specs.get(name)
        if spec is None or spec.error is not None or name in m.adapters:
            return False
        if spec.bytes > self.budget_bytes or not self._evict(m, spec.bytes):
            return False
        try:
            m.load_adapter(spec)
        except AdapterError:
            return False
        m.adapters.move_to_end(name, last=False)  # not used yet: first out if room is short before its turn
        self.counters.prefetches += 1
        return True

    # --- a model replaced (reload, tier change, warm swap) ---

    def _check_base(self, m: LoadedModel) -> None:
        """An adapter whose file names another architecture than its base tier's is unusable: say so once."""
        arch = m.architecture
        for name, spec in list(self.specs.items()):
            if spec.base == m.spec.name and spec.error is None and spec.arch != arch:
                why = f"its architecture {spec.arch!r} is not its base tier {spec.base!r}'s ({arch!r})"
                self.specs[name] = _bad(spec, why)
                log.error("engine.adapter_invalid", adapter=name, error=why)

    def closing(self, m: LoadedModel, *, carry: str) -> None:
        """`m` is about to be closed (llama.cpp frees its adapters with it). `carry`: which of them the next model
        loads again (`opened`): "all" that fit (a reload), "active" (a pause: the answer goes on with its adapter,
        the rest of the pool's memory is given back), "none" (an idle unload, a stop)."""
        loaded = list(m.adapters) if carry == "all" else [m.adapter] if m.adapter is not None else []
        self._carry = (loaded, m.adapter) if carry != "none" else None
        self.last_carry = None

    def opened(self, m: LoadedModel) -> Carried | None:
        """Load into the new model the adapters the old one had, those that fit its architecture and the budget
        (most recently used first), and set the active one again; say what was dropped and why."""
        self._check_base(m)
        if self._carry is None:
            return None
        loaded, active = self._carry
        self._carry = None
        carried = Carried()
        order = ([active] if active is not None else []) + [n for n in reversed(loaded) if n != active]
        for name in order:
            if name in m.adapters:
                carried.kept.append(name)
                continue
            spec = self.specs[name]
            if self.used_bytes(m) + spec.bytes > self.budget_bytes:
                carried.dropped[name] = "no room in the LoRA pool"
                continue
            try:
                m.load_adapter(spec)
            except AdapterError as exc:
                carried.dropped[name] = exc.message
                continue
            m.adapters.move_to_end(name, last=False)  # keep the old LRU order: most recent last
            carried.kept.append(name)
        if active is not None and active in m.adapters:
            m.set_adapter(active, self.specs[active].scale)
            m.adapters.move_to_end(active)
        elif m.adapter is None and active is not None:
            m.clear_cache()  # a cache copied from the old context was computed with an adapter this one lacks
        self.last_carry = carried
        if carried.dropped:
            log.warning("engine.adapters_dropped", tier=m.spec.name, dropped=carried.dropped, kept=carried.kept)
        return carried
