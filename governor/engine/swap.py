"""A warm swap: the new KV cache built beside the old one while the answer goes on (issue 11, point 3).

A change of KV type mid-answer must evaluate the whole conversation again in the new cache. Cold, the answer stops
for unload + load + prefill. Warm — when there is memory for a second context of the same weights (llama.cpp maps
the file, so only the new cache, its compute buffer and any repacked weights are new) — a thread builds the new
context and prefills the answer's tokens so far with half of the threads while the worker decodes on with the other
half; at the first token boundary after it is ready the worker switches: the new context evaluates only the tokens
that came meanwhile (llama-cpp-python's prefix reuse), the old one is closed. The client sees a slower stretch
instead of a pause. A newer change or the end of the answer waits for the build (it is the conversation's cache),
a shutdown cancels it (llama.cpp's abort callback stops the prefill between graph nodes).

Model changes stay cold: two models' weights at once is what a device short of memory cannot afford.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import psutil

from governor.engine.adapterspec import AdapterSpec
from governor.engine.config import ModelSpec
from governor.engine.jobs import ConfigJob
from governor.engine.model import LoadedModel
from governor.engine.plan import next_round, second_context_bytes, why_cold
from policies.decision import EngineConfig
from policies.memfit import MIB, ModelFootprint


def cold_reason(model: LoadedModel, settings: EngineConfig, target: EngineConfig, tokens: int, room: int) -> str | None:
    """None when `target` can be built warm beside `model` (governor.engine.plan.why_cold), else why not; the memory
    is asked last: what a second context of the loaded weights adds, against what the system has available."""

    def memory() -> tuple[float, float]:
        return extra_bytes(model, target), float(psutil.virtual_memory().available)

    return why_cold(settings, target, threads=model.threads, tokens=tokens, room=room, memory=memory)


def extra_bytes(model: LoadedModel, target: EngineConfig) -> float:
    """A second context of `model`'s weights with `target` (governor.engine.plan.second_context_bytes), counting the
    weights llama.cpp copied out of the mapped file (repacked: CPU_REPACK, AMX)."""
    llm = model.llm
    meta: dict[str, str] = llm.metadata
    footprint = ModelFootprint.from_fields(model.spec.path, meta.get, n_vocab=llm.n_vocab())
    copied = sum(mib for name, mib in model.weight_buffers_mib.items() if name != "CPU_Mapped") * MIB
    return second_context_bytes(footprint, target, copied)


class WarmSwap:
    """Builds `target` in a thread: load, then prefill `tokens` with `threads` threads.

    `tokens` is the answer's live list (the worker appends each new token): after the prefill the thread also
    evaluates what was added meanwhile, a few rounds, so that the switch itself has one or two tokens left to do.
    """

    def __init__(
        self,
        spec: ModelSpec,
        target: EngineConfig,
        tokens: Sequence[int],
        *,
        threads: int,
        extra_buffers: bool,
        job: ConfigJob,
        adapter: AdapterSpec | None = None,
    ) -> None:
        self.target = target
        self.job = job
        self.started = time.perf_counter()
        self.model: LoadedModel | None = None
        self.error: Exception | None = None
        self._cancelled = False
        self._done = threading.Event()
        build = target.model_copy(update={"threads": threads})
        self._thread = threading.Thread(
            target=self._build, args=(spec, build, tokens, extra_buffers, adapter), name="engine-swap", daemon=True
        )
        self._thread.start()

    def _build(
        self,
        spec: ModelSpec,
        build: EngineConfig,
        tokens: Sequence[int],
        extra_buffers: bool,
        adapter: AdapterSpec | None,
    ) -> None:
        try:
            self.model = LoadedModel(spec, build, extra_buffers=extra_buffers)
            if adapter is not None:  # the answer's adapter computes the new cache too (this model is ours alone)
                self.model.load_adapter(adapter)
                self.model.set_adapter(adapter.name, adapter.scale)
            llm = self.model.llm
            with self.model.interruptible():
                done, rounds = 0, 0
                while not self._cancelled:  # checked after `interruptible` cleared the abort flag
                    goal = next_round(done, len(tokens), rounds)
                    if goal is None:
                        break
                    llm.eval(tokens[done : int(goal)])
                    done, rounds = int(goal), rounds + 1
        except Exception as exc:  # reported by take(); the old context goes on
            self.error = exc
        finally:
            self._done.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def take(self) -> LoadedModel | None:
        """The built context (waiting for it), or None when it failed (`error` says why)."""
        self._done.wait()
        if self.error is not None and self.model is not None:
            self.model.close()
            self.model = None
        return self.model

    def cancel(self) -> None:
        self._cancelled = True
        if self.model is not None:
            self.model.abort()
        self._done.wait()
        if self.model is not None:
            self.model.close()
            self.model = None
