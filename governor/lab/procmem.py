"""The simulated engine process's memory, as the kernel sees it: what it takes under its settings, which part the
kernel can take back (the mapped weights are page cache, EngineSpec.weights_reclaimable), what the page cache could
not keep in the room other programs leave (read from storage again at every token), and which model files are still
in the page cache (a restart or a new model reads them at cached_load_mb_s, else at load_mb_s).

governor.lab.engine adds what it holds beside (the LoRA pool, a warm swap's second context) and whether the model is
loaded; governor.lab.world reads the results into the snapshot (RSS, RssAnon) and sets the room each step.
"""

from __future__ import annotations

from governor.lab.device import MB, EngineSpec, SimModelSpec
from policies.decision import EngineConfig


class ProcessMemory:
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.footprint = 0  # bytes the process takes once loaded with the current config
        self.weights = 0.0  # of which the model's weights
        self.room_bytes = float("inf")  # what other programs leave (the world sets it each step)
        self._cached: set[str] = set()  # models read once stay in the page cache (mmap) unless memory runs out

    def set(self, tier: SimModelSpec, config: EngineConfig) -> None:
        self.weights = tier.weights_mb * MB
        self.footprint = self.spec.footprint_bytes(tier, config.n_ctx, config.kv_type, config.n_batch)

    def read_s(self, tier: SimModelSpec) -> float:
        """Seconds to read `tier`'s weights: from the page cache when it was read before, else from storage."""
        cached = tier.name in self._cached
        self._cached.add(tier.name)
        return tier.weights_mb / (self.spec.cached_load_mb_s if cached else self.spec.load_mb_s)

    def drop_cache(self) -> None:
        """Memory ran out: the page cache was dropped first."""
        self._cached.clear()

    def unreclaimable(self, pool: float, swap: float) -> float:
        """What the kernel cannot take back from the loaded process short of killing it, with the LoRA `pool` and a
        warm `swap`'s second context held beside."""
        own = self.footprint - self.weights if self.spec.weights_reclaimable else float(self.footprint)
        return own + pool + swap

    def evicted(self, pool: float, swap: float) -> float:
        """Weights the page cache could not keep in the room left: read from storage again at every token."""
        if not self.spec.weights_reclaimable:
            return 0.0
        return max(0.0, self.weights - max(0.0, self.room_bytes - self.unreclaimable(pool, swap)))

    def resident(self, pool: float, swap: float) -> int:
        """The loaded process's memory (RSS): all of it, less the weights evicted from the page cache."""
        return int(self.footprint + pool + swap - self.evicted(pool, swap))

    def anon(self, pool: float, swap: float) -> int:
        """Of the loaded process's resident memory, what is not the mapped weights' page cache (RssAnon)."""
        weights = self.weights - self.evicted(pool, swap) if self.spec.weights_reclaimable else 0.0
        return max(0, int(self.resident(pool, swap) - weights))
