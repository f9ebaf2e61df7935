"""The simulated device's description: a TOML file users write for their own board (format in docs/lab.md)."""

from __future__ import annotations

import itertools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.decision import KvType
from policies.memfit import ModelFootprint  # the policy's own memory arithmetic

MB = 1 << 20


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ThermalSpec(Spec):
    """Two lumped RC stages: die (SoC, small C) -> case/board/skin (large C) -> ambient."""

    r_die_case_k_per_w: float = Field(gt=0)
    c_die_j_per_k: float = Field(gt=0)
    r_case_ambient_k_per_w: float = Field(gt=0)
    c_case_j_per_k: float = Field(gt=0)


class PowerSpec(Spec):
    idle_w: float = Field(ge=0)
    thread_w: float = Field(ge=0)  # one fully busy core at the maximum frequency
    freq_exponent: float = Field(default=2.5, ge=1, le=4)  # P_core ∝ (f/f_max)^k: f·V² with V rising with f


class CpuSpec(Spec):
    cores: int = Field(ge=1, le=256)  # all cores, big and little
    little_cores: int = Field(default=0, ge=0)  # of which slow (big.LITTLE); threads go to big cores first
    little_speed: float = Field(default=0.35, gt=0, le=1)  # a little core's per-thread speed relative to a big one
    little_thread_w: float = Field(default=0.2, ge=0)  # a busy little core's power at f_max
    freq_steps: tuple[float, ...] = Field(min_length=1)  # frequency ratio per cooling state; state 0 is 1.0
    poll_s: float = Field(default=1.0, gt=0)  # the thermal zone's passive polling delay
    freq_writable: bool = True  # may the governor write scaling_max_freq (Android without root: no)
    # The CPU's own thermal control under the kernel's view (x86: TCC clock modulation at TjMax, PROCHOT): at this die
    # temperature the cores duty-cycle to hold it, whatever the kernel's step (None: none, the kernel's trips alone)
    hw_limit_c: float | None = Field(default=None, gt=0, le=150)

    @model_validator(mode="after")
    def _descending(self) -> CpuSpec:
        steps = self.freq_steps
        if self.little_cores >= self.cores:
            raise ValueError(f"little_cores ({self.little_cores}) must leave at least one big core of {self.cores}")
        if steps[0] != 1.0 or any(b > a for a, b in itertools.pairwise(steps)) or steps[-1] <= 0:
            raise ValueError(f"freq_steps must start at 1.0 and not increase, got {list(steps)}")
        return self


class TripSpec(Spec):
    type: Literal["passive", "critical"]
    temp_c: float
    hysteresis_c: float = Field(default=2.0, ge=0)
    max_state: int | None = Field(default=None, ge=1)  # deepest cooling state this trip may ask for; None = all


class ZoneSpec(Spec):
    label: str = Field(min_length=1)  # the zone's `type`, e.g. "cpu-thermal", "skin-therm"
    node: Literal["die", "case"]
    trip: tuple[TripSpec, ...] = ()


class BatterySpec(Spec):
    capacity_wh: float = Field(gt=0)
    percent: float = Field(default=100.0, ge=0, le=100)
    plugged: bool = False
    charge_w: float = Field(default=10.0, ge=0)  # what the charger adds to the battery on top of the load


class MemorySpec(Spec):
    total_mb: float = Field(gt=0)
    other_apps_mb: float = Field(default=0.0, ge=0)  # the OS and everything else that is not the engine


class SimModelSpec(Spec):
    """One tier of the device's model ladder (largest first): its GGUF header figures and how fast it runs."""

    name: str = Field(min_length=1)
    weights_mb: float = Field(gt=0)  # GGUF file size: all weights are read once per decoded token
    n_layer: int = Field(ge=1)
    n_embd: int = Field(ge=1)
    n_head: int = Field(ge=1)
    n_head_kv: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    n_vocab: int = Field(ge=1)
    n_ctx: int = Field(default=4096, ge=64)  # largest context the tier is run with
    kv_type: KvType = "f16"
    thread_tok_s: float = Field(gt=0)  # decode tokens/s one big core gives at f_max (compute-limited)
    prefill_thread_tok_s: float = Field(gt=0)  # prompt tokens/s one big core evaluates at f_max

    def footprint(self) -> ModelFootprint:
        """The policy's own memory arithmetic (policies.memfit) describes the simulated model too."""
        return ModelFootprint(
            file_bytes=int(self.weights_mb * MB),
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
            n_head_kv=self.n_head_kv,
            head_dim_k=self.head_dim,
            head_dim_v=self.head_dim,
            n_vocab=self.n_vocab,
        )

    def kv_bytes_per_token(self, kv_type: KvType) -> float:
        return self.footprint().kv_bytes(1, kv_type)


class SimAdapterSpec(Spec):
    """A LoRA adapter file on the device (issue 32): what loading it reads and what it holds in the pool."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    size_mb: float = Field(gt=0, le=2048)


class EngineSpec(Spec):
    # What serves the tokens (docs/engines.md): the built-in engine changes threads live and every other setting in
    # place; llama-server only by a restart (the slot saved and restored where llama.cpp can, else re-evaluated).
    kind: Literal["llama-cpp-python", "llama-server"] = "llama-cpp-python"
    bandwidth_gb_s: float = Field(gt=0)  # sustained memory bandwidth the decode loop gets
    load_mb_s: float = Field(default=200.0, gt=0)  # storage read speed the first time a model is loaded
    cached_load_mb_s: float = Field(default=3000.0, gt=0)  # mmap of a model still in the page cache (a reload)
    context_s: float = Field(default=0.3, ge=0)  # building a new context (KV cache, compute buffers)
    restart_s: float = Field(default=2.0, ge=0)  # process start after an OOM kill, before the load
    server_start_s: float = Field(default=0.3, ge=0)  # llama-server's own start (a C++ program), before the load
    overhead_mb: float = Field(default=150.0, ge=0)  # the process itself: runtime, libraries, buffers
    # Speed per core share when the engine's threads and other processes want more cores than there are: llama.cpp's
    # threads wait for each other at every step, so a descheduled one stalls them all. 2 cores, 2 threads beside one
    # CPU hog: 25 tok/s measured where a fair 2/3 share of the 78 alone would give 52 (docs/lab.md).
    barrier_efficiency: float = Field(default=0.48, gt=0, le=1)
    # llama.cpp maps the GGUF file (use_mmap, its default), so the weights are page cache: clean file pages the kernel
    # reclaims before it calls the OOM killer (Documentation/admin-guide/mm/concepts.rst, "Reclaim" and "OOM
    # killer"). An engine short of room for them is not killed: it re-reads the evicted part from storage at every
    # token (thrashing, at load_mb_s). Only its anonymous memory (KV, compute buffer, runtime) can get it killed.
    # false: the weights count as unreclaimable too, as where a repack or --no-mmap copied them into anonymous
    # buffers, or where a userspace killer acts on memory pressure first (Android's lmkd kills on PSI).
    weights_reclaimable: bool = True
    model: tuple[SimModelSpec, ...] = Field(min_length=1)
    adapter: tuple[SimAdapterSpec, ...] = ()  # LoRA adapters requests may name (governor.lab.adapters)
    # Changing the context's adapter: llama.cpp re-reserves its compute graph at the next decode, and the engine parks
    # the outgoing KV cache (bench/bench_adapters.py measures it: docs/benchmarks.md).
    adapter_switch_s: float = Field(default=0.03, ge=0, le=10)

    def tier(self, name: str) -> SimModelSpec:
        for m in self.model:
            if m.name == name:
                return m
        # a policy may name a tier the device lacks; the engine then runs the smallest one, as a real ladder would
        return self.model[-1]

    def footprint_bytes(self, tier: SimModelSpec, n_ctx: int, kv_type: KvType, n_batch: int) -> int:
        """What the engine process really takes: weights + KV + compute buffer (Ollama's estimate: it grows with
        n_batch, the prompt tokens evaluated per step) + overhead."""
        fp = tier.footprint()
        extra = fp.kv_bytes(n_ctx, kv_type) + fp.compute_bytes(n_ctx, n_batch) + self.overhead_mb * MB
        return int(fp.file_bytes + extra)


class SimSpec(Spec):
    dt_s: float = Field(default=0.25, gt=0, le=5)  # physics step; exact per step, so only event timing depends on it


class DeviceSpec(Spec):
    name: str = Field(min_length=1)
    description: str = ""
    ambient_c: float = Field(ge=-40, le=60)
    thermal: ThermalSpec
    power: PowerSpec
    cpu: CpuSpec
    zone: tuple[ZoneSpec, ...] = Field(min_length=1)
    memory: MemorySpec
    engine: EngineSpec
    battery: BatterySpec | None = None
    sim: SimSpec = SimSpec()

    @model_validator(mode="after")
    def _limits(self) -> DeviceSpec:
        if not any(t.type == "passive" for z in self.zone for t in z.trip):
            raise ValueError("at least one zone needs a passive trip (what the kernel throttles on)")
        return self

    def limit_zone(self) -> tuple[int, TripSpec]:
        """The zone whose passive trip is reached first at full load: where the device limits (die or skin)."""
        best: tuple[float, int, TripSpec] | None = None
        cpu = self.cpu
        full_w = self.power.idle_w + (cpu.cores - cpu.little_cores) * self.power.thread_w
        for i, z in enumerate(self.zone):
            rise = full_w * self.thermal.r_case_ambient_k_per_w
            if z.node == "die":
                rise += full_w * self.thermal.r_die_case_k_per_w
            for trip in z.trip:
                if trip.type == "passive":
                    margin = (trip.temp_c - self.ambient_c) / rise  # fraction of full power it sustains
                    if best is None or margin < best[0]:
                        best = (margin, i, trip)
        assert best is not None  # the validator guarantees a passive trip
        return best[1], best[2]
