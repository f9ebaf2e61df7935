"""The simulated engine's LoRA adapter pool (issue 32): what a request's adapter costs, as the real engine pays it.

- the adapter of the previous answer again: nothing;
- another adapter (or none after one): `switch_s` (llama.cpp re-reserves its compute graph), and the KV cache was
  computed with the other one, so the conversation is evaluated again;
- one the pool does not hold (a miss): also its file read, from storage (`load_mb_s`) or from the page cache
  (`cached_load_mb_s`) when it was read before, and the least recently used adapters freed to fit `lora_pool_mib`;
- one larger than the whole pool: the request fails (the engine answers 503 `adapter_pool_full`).

The real engine also parks the outgoing adapter's cache in the pool's spare room and puts it back on the way back;
this model does not (pessimistic for clients that alternate). Figures: bench/bench_adapters.py, docs/benchmarks.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from governor.lab.device import MB


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    switches: int = 0
    evictions: int = 0
    refused: int = 0


class SimPool:
    def __init__(self, sizes_mb: Mapping[str, float], *, switch_s: float, load_mb_s: float, cached_mb_s: float) -> None:
        self.sizes = {name: mb * MB for name, mb in sizes_mb.items()}
        self.switch_s = switch_s
        self.load_mb_s = load_mb_s
        self.cached_mb_s = cached_mb_s
        self.budget = 0.0
        self.loaded: OrderedDict[str, float] = OrderedDict()  # least recently used first
        self.active: str | None = None
        self.cached: set[str] = set()  # files in the page cache
        self.stats = PoolStats()

    def held_bytes(self) -> float:
        return sum(self.loaded.values())

    def resize(self, budget_bytes: float) -> None:
        self.budget = budget_bytes
        self._fit(0.0, keep=self.active)

    def forget(self) -> None:
        """The model was closed (a reload or a restart): its adapters went with it; the page cache stays."""
        self.loaded.clear()
        self.active = None

    def drop_page_cache(self) -> None:
        self.cached.clear()

    def use(self, name: str | None) -> tuple[float, bool] | None:
        """(seconds before the prompt can be evaluated, whether the KV cache was lost) for an answer with adapter
        `name` (None: the base model); None when the pool cannot hold it."""
        if name == self.active:
            if name is not None:
                self.stats.hits += 1
            return 0.0, False
        seconds = self.switch_s
        if name is not None:
            size = self.sizes.get(name, 0.0)
            if size > self.budget:
                self.stats.refused += 1
                return None
            if name in self.loaded:
                self.stats.hits += 1
                self.loaded.move_to_end(name)
            else:
                self.stats.misses += 1
                self._fit(size, keep=None)
                rate = self.cached_mb_s if name in self.cached else self.load_mb_s
                seconds += size / (rate * MB)
                self.cached.add(name)
                self.loaded[name] = size
        self.active = name
        self.stats.switches += 1
        return seconds, True

    def _fit(self, need: float, *, keep: str | None) -> None:
        for victim in list(self.loaded):
            if self.held_bytes() + need <= self.budget:
                return
            if victim != keep:
                del self.loaded[victim]
                self.stats.evictions += 1
