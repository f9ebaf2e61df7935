"""CPU frequency from `sys/devices/system/cpu/cpu*/cpufreq` (memory is sensors/memory.py).

Throttling rule (documented in docs/sensors.md), against the limit the governor itself set on a policy (its own
`scaling_max_freq` write, `own_caps`), else `cpuinfo_max_freq`:
- capped: some online CPU has `scaling_max_freq` under that limit (a thermal driver or a user lowered the cap: the
  kernel shows the lowest of every request, its cooling devices' and ours);
- or starved under load: CPU utilisation >= 90 % while the mean `scaling_cur_freq` over that limit is < 0.6
  (firmware throttling, e.g. a Raspberry Pi's, lowers the clock without touching the cap).
Without a utilisation figure only the first rule applies. The governor's own cap is not throttling: the policy
moves its setpoint away from the trip while the kernel holds a step of its own.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sensors.load import Load
from sensors.root import Reader, Root
from sensors.snapshot import Cluster, Cpu

CPU_DIR = "sys/devices/system/cpu"
LOADED_UTIL_PERCENT = 90.0
STARVED_RATIO = 0.6
CAP_TOLERANCE = 0.01  # a limit this close to the one asked for is the one asked for (drivers round a write)

_CPU_RE = re.compile(r"cpu(\d+)$")


@dataclass(frozen=True, slots=True)
class Core:
    """The CPUs that share one clock (a cpufreq policy: `cpuN/cpufreq` links to `cpufreq/policyP`), read once."""

    numbers: tuple[int, ...]
    cur_path: str
    scaling_max_path: str | None  # absent on a few drivers: then only the load rule can say "throttled"
    max_khz: float  # cpuinfo_max_freq: the hardware's limit does not change while running
    policy: str = ""  # the policy directory, resolved: the key of the governor's own cap on it (`own_caps`)
    capacity: float | None = None  # cpuN/cpu_capacity (arm64: the scheduler's per-core compute capacity, 0-1024)


@dataclass(frozen=True, slots=True)
class CpuInventory:
    cores: tuple[Core, ...]
    online_path: str | None  # sys/devices/system/cpu/online, read each sample: phones hot-unplug cores


def discover_cpus(root: Root, reader: Reader) -> CpuInventory:
    """The CPUs with cpufreq, grouped by the policy directory their `cpufreq` resolves to (a Pi's four cores: one
    policy, two files a sample instead of eight; a fake tree's per-CPU directories: one group each)."""
    base = root.path(CPU_DIR)
    groups: dict[str, list[int]] = {}
    for number in sorted(int(m.group(1)) for m in map(_CPU_RE.match, reader.listdir(base)) if m):
        groups.setdefault(os.path.realpath(f"{base}/cpu{number}/cpufreq"), []).append(number)
    cores: list[Core] = []
    for policy, numbers in groups.items():
        freq = f"{base}/cpu{numbers[0]}/cpufreq"
        if not root.exists(f"{freq}/scaling_cur_freq") or reader.is_denied(f"{freq}/scaling_cur_freq"):
            continue
        max_khz = reader.number(f"{freq}/cpuinfo_max_freq")
        if not max_khz or max_khz <= 0:
            continue
        scaling_max = f"{freq}/scaling_max_freq"
        cur, cap = f"{freq}/scaling_cur_freq", scaling_max if root.exists(scaling_max) else None
        capacity_path = f"{base}/cpu{numbers[0]}/cpu_capacity"
        capacity = reader.number(capacity_path) if root.exists(capacity_path) else None
        cores.append(Core(tuple(numbers), cur, cap, max_khz, policy, capacity if capacity and capacity > 0 else None))
    online = f"{base}/online"
    return CpuInventory(tuple(cores), online if root.exists(online) else None)


@functools.lru_cache(maxsize=8)
def parse_cpu_list(text: str) -> frozenset[int]:
    """The kernel's cpu list format: "0-3,5,7-8" (read every sample; it changes when a core is hot-plugged)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if first:
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def clusters_of(cores: tuple[Core, ...], online: frozenset[int] | None) -> tuple[Cluster, ...]:
    """The online CPUs grouped by per-core speed, fastest first: `cpu_capacity` where every policy has it (arm64),
    else `cpuinfo_max_freq`. Empty when all are alike: nothing to choose between."""
    speeds = [c.capacity for c in cores] if cores and all(c.capacity for c in cores) else [c.max_khz for c in cores]
    if len({s for s in speeds if s}) < 2:
        return ()
    top = max(s for s in speeds if s)
    by_speed: dict[float, list[int]] = {}
    for core, speed in zip(cores, speeds, strict=True):
        cpus = [n for n in core.numbers if online is None or n in online]
        if speed and cpus:
            by_speed.setdefault(round(speed / top, 3), []).extend(cpus)
    if len(by_speed) < 2:
        return ()
    return tuple(Cluster(cpus=tuple(sorted(c)), capacity=cap) for cap, c in sorted(by_speed.items(), reverse=True))


def read_cpu(
    reader: Reader,
    inventory: CpuInventory,
    util_percent: float | None,
    load: Load | None = None,
    own_caps: Mapping[str, int] | None = None,
) -> Cpu:
    """`own_caps`: the kHz the governor wrote to each policy's `scaling_max_freq` (by `Core.policy`)."""
    load = load if load is not None else Load()
    online: frozenset[int] | None = None
    if inventory.online_path is not None:
        text = reader.text(inventory.online_path)
        if text is not None:
            try:
                online = parse_cpu_list(text)
            except ValueError:
                reader.problem(inventory.online_path, f"not a cpu list: {text[:40]!r}")
    ratio_sum = held_sum = 0.0
    ratio_cpus = 0
    capped = False
    for core in inventory.cores:
        cpus = len(core.numbers) if online is None else sum(n in online for n in core.numbers)
        if not cpus:
            continue
        owned = own_caps.get(core.policy) if own_caps else None
        limit = core.max_khz if owned is None else owned
        cur = reader.number(core.cur_path)
        if cur is not None:
            ratio_sum, ratio_cpus = ratio_sum + min(cur / core.max_khz, 1.0) * cpus, ratio_cpus + cpus
            held_sum += min(cur / limit, 1.0) * cpus
        cap = reader.number(core.scaling_max_path) if core.scaling_max_path else None
        if cap is not None and cap < (limit if owned is None else owned * (1 - CAP_TOLERANCE)):
            capped = True
    ratio = ratio_sum / ratio_cpus if ratio_cpus else None  # the mean over online CPUs
    throttled: bool | None = None
    if inventory.cores:
        starved = (
            util_percent is not None
            and ratio_cpus > 0
            and util_percent >= LOADED_UTIL_PERCENT
            and held_sum / ratio_cpus < STARVED_RATIO
        )
        throttled = capped or starved
    count = len(online) if online is not None else (sum(len(c.numbers) for c in inventory.cores) or None)
    return Cpu(
        clusters=clusters_of(inventory.cores, online),
        freq_ratio=ratio,
        throttled=throttled,
        count=count,
        util_percent=util_percent,
        other_cores=load.other_cores,
        engine_cores=load.engine_cores,
        run_queue=load.run_queue,
        psi_some_avg10=load.psi_some_avg10,
        psi_full_avg10=load.psi_full_avg10,
    )
