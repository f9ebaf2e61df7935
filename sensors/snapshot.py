"""The typed readings every other part consumes: one `Snapshot` per sample.

This is the contract of `governor sensors --json` and the line format of recorded traces. Unknown is `None`,
never 0 or -1. Units are in the field names and converted once, at the edge (the backends).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# An engine's figures as anything outside may report them (its status, a trace line): larger is not a real engine.
TOKENS_PER_S_MAX = 1e6
BYTES_MAX = 1 << 50


class Frozen(BaseModel):
    # Every number here came from outside (sysfs, an engine, a trace file): finite, or a validation error naming it.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


TempKind = Literal["thermal_zone", "hwmon", "battery", "psutil", "termux", "simulated"]


class Trip(Frozen):
    """A trip point the device itself declares (thermal zone trip types; hwmon `max` and `crit`)."""

    type: str  # "passive", "critical", "hot", "active" (thermal zones), "max", "crit" (hwmon)
    temp_c: float


class Temperature(Frozen):
    source: str  # where it came from, e.g. "thermal_zone0" or "hwmon2/temp1"
    kind: TempKind
    label: str  # the zone's type, the hwmon name/label, or the battery's name
    temp_c: float | None
    trips: tuple[Trip, ...] = ()


class Battery(Frozen):
    percent: float | None
    charging: bool | None
    plugged: bool | None  # on external power (mains/USB online, or the battery says so)
    power_w: float | None  # magnitude of the power flowing in or out of the battery
    temp_c: float | None
    source: str  # "sysfs:BAT0", "termux", "psutil", "simulated"
    energy_wh: float | None = None
    energy_full_wh: float | None = None
    age_s: float | None = None  # how old a cached reading is (termux-battery-status runs in the background)


class Memory(Frozen):
    total_bytes: int | None
    available_bytes: int | None
    swap_total_bytes: int | None = None
    swap_free_bytes: int | None = None
    psi_some_avg10: float | None = None  # % of the last 10 s some task stalled on memory
    psi_full_avg10: float | None = None
    # A userspace low-memory killer acts on pressure before the kernel's OOM killer (Android's lmkd): the engine's
    # mapped weights count as memory it needs, not page cache the kernel would reclaim first.
    lmkd: bool | None = None


class Cluster(Frozen):
    """CPUs that share a clock (a cpufreq policy) and a per-core speed: big.LITTLE's clusters, x86 P and E cores."""

    cpus: tuple[int, ...]  # online CPU numbers
    # Compute capacity of one core relative to the fastest cluster's (1.0): `cpu_capacity` (arm64, 0-1024, the
    # scheduler's own figure), else cpuinfo_max_freq (x86 hybrid: no per-clock speed is published).
    capacity: float = Field(gt=0, le=1)


class Cpu(Frozen):
    freq_ratio: float | None  # mean scaling_cur_freq / cpuinfo_max_freq over online CPUs
    throttled: bool | None  # the frequency is held below its maximum (scaling_max_freq < cpuinfo_max_freq)
    count: int | None = None
    util_percent: float | None = None
    other_cores: float | None = None  # cores' worth of CPU time processes other than the engine used (proc/stat)
    engine_cores: float | None = None  # the engine process's own, over the same interval
    run_queue: int | None = None  # runnable tasks (proc/stat procs_running, the reader included)
    psi_some_avg10: float | None = None  # % of the last 10 s some runnable task waited for a CPU
    psi_full_avg10: float | None = None
    # Clusters of different per-core speed, fastest first; empty when every online CPU is alike (or unknown).
    clusters: tuple[Cluster, ...] = ()


class Problem(Frozen):
    path: str
    reason: str


class Snapshot(Frozen):
    temperatures: tuple[Temperature, ...] = ()
    battery: Battery | None = None
    memory: Memory = Memory(total_bytes=None, available_bytes=None)
    cpu: Cpu = Cpu(freq_ratio=None, throttled=None)
    problems: tuple[Problem, ...] = ()


class EngineObservation(Frozen):
    """What the loop knows of the engine at a tick; optional in a trace line."""

    busy: bool
    tokens_per_s: float | None = Field(default=None, ge=0, le=TOKENS_PER_S_MAX)
    model: str | None = None
    rss_bytes: int | None = Field(default=None, ge=0, le=BYTES_MAX)
    # Of rss_bytes, what is not file-backed (RSS minus the mapped files' resident pages: KV cache, compute buffer,
    # runtime): what the kernel cannot reclaim short of killing the process.
    anon_bytes: int | None = Field(default=None, ge=0, le=BYTES_MAX)
    loaded: bool | None = None  # False: the engine unloaded its model after --keep-alive idle seconds
    # The threads the engine runs with now (what tokens_per_s was measured at); bounded as the setting is.
    threads: int | None = Field(default=None, ge=1, le=1024)
    # Tokens in the KV cache (the context's fill) now; at most the largest n_ctx a policy may set (policies' `Ctx`).
    context_tokens: int | None = Field(default=None, ge=0, le=1 << 20)
    given_up: str | None = None  # the daemon's supervisor gave the engine up after repeated failures: why


class TraceRecord(Snapshot):
    """One line of a recorded trace: a snapshot, its time and, optionally, what the engine was doing."""

    t: float
    engine: EngineObservation | None = None
