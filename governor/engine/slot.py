"""The model in memory, or none: loads it (reporting llama.cpp's progress), warms it up, and unloads it when idle.

Only the worker thread calls `load`/`unload`; the event loop reads `progress` and `loaded` for status and for
deciding how long a request may wait for a load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from governor.engine.adapters import AdapterPool
from governor.engine.config import ModelSpec
from governor.engine.model import LoadedModel
from policies.decision import EngineConfig

log = structlog.get_logger("governor.engine")


@dataclass
class LoadProgress:
    model: str
    why: str  # "start", "idle" (a request after an idle unload) or "config"
    started: float = field(default_factory=time.monotonic)
    fraction: float = 0.0  # llama.cpp's progress callback: tensors loaded, 0..1

    def remaining_s(self, now: float) -> float | None:
        """Time left if the load goes on at its pace so far; None before any progress."""
        if self.fraction <= 0.0:
            return None
        elapsed = now - self.started
        return elapsed * (1.0 - self.fraction) / self.fraction

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "why": self.why,
            "progress": round(self.fraction, 4),
            "elapsed_s": round(time.monotonic() - self.started, 3),
        }


# Which LoRA adapters a model's successor loads again (governor.engine.adapters): a reload all that fit, a memory
# pause the one its answer runs with; an idle unload or a stop none (the next request loads what it needs).
CARRY = {"config": "all", "paused": "active"}


class Slot:
    def __init__(
        self, keep_alive_s: float | None, *, extra_buffers: bool = True, pool: AdapterPool | None = None
    ) -> None:
        self.keep_alive_s = keep_alive_s  # None: never unload
        # The LoRA adapters loaded on the model: a reload carries them to the new model (those that fit).
        self.pool = pool if pool is not None else AdapterPool({}, 0)
        self.extra_buffers = extra_buffers  # llama_model_params.use_extra_bufts (governor.engine.extra_buffers)
        self.weight_buffers_mib: dict[str, float] = {}  # the last load's, as llama.cpp reported them
        self.current: LoadedModel | None = None
        self.progress: LoadProgress | None = None
        self.last_used = time.monotonic()
        self.loads_total = 0
        self.unloads_total = 0
        self.last_load_s: float | None = None

    @property
    def loaded(self) -> bool:
        return self.current is not None

    def load(self, spec: ModelSpec, settings: EngineConfig, *, why: str, warm: bool) -> LoadedModel:
        """Build the model (raises ModelLoadError); with `warm`, one decode so that the first real token is not
        the one that pays for the compute buffers' first use."""
        assert self.current is None, "unload first: memory is what a device lacks"
        progress = self.progress = LoadProgress(spec.name, why)

        def on_progress(fraction: float) -> None:
            progress.fraction = fraction

        try:
            model = LoadedModel(spec, settings, on_progress=on_progress, extra_buffers=self.extra_buffers)
            if warm:
                model.warm_up()
        finally:
            self.progress = None
        self.current = model
        self.weight_buffers_mib = model.weight_buffers_mib
        self.loads_total += 1
        self.last_load_s = time.monotonic() - progress.started
        self.touch()
        self.pool.opened(model)
        log.info("engine.model_loaded", model=spec.name, why=why, seconds=round(self.last_load_s, 3))
        return model

    def replace(self, model: LoadedModel) -> None:
        """Put a model built elsewhere (governor.engine.swap) in place of the current one, which is closed."""
        self.unload(why="config")
        self.current = model
        self.weight_buffers_mib = model.weight_buffers_mib
        self.loads_total += 1
        self.touch()
        self.pool.opened(model)

    def unload(self, *, why: str) -> None:
        if self.current is None:
            return
        name = self.current.spec.name
        self.pool.closing(self.current, carry=CARRY.get(why, "none"))  # which adapters the next load takes again
        self.current.close()
        self.current = None
        self.unloads_total += 1
        if why == "idle":
            log.info("engine.unloaded", model=name, idle_s=self.keep_alive_s)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def idle_wait(self) -> float | None:
        """How long the worker may wait for work before unloading; None: wait forever."""
        if self.current is None or not self.keep_alive_s:
            return None
        return max(0.0, self.last_used + self.keep_alive_s - time.monotonic())
