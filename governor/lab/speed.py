"""The simulated engine's speed (docs/lab.md, "The engine"): where its threads run, and the tokens a second they make.

Threads go to big cores first, among the CPUs allowed; more threads than allowed CPUs share them and wait at every
step's barrier for the descheduled ones. Decode is the lesser of compute (threads x clock x a thread's tokens/s, the
slowest core setting the pace) and memory bandwidth (all weights and the KV cache read per token); prefill is
compute-bound at the n_batch's efficiency (governor.lab.stats.batch_efficiency); weights the page cache could not
keep are read again from storage, once per decoded token and once per prompt batch. Pure: figures in, rates out;
governor.lab.engine keeps the state.
"""

from __future__ import annotations

from typing import NamedTuple

from governor.lab.device import CpuSpec, SimModelSpec


class Placement(NamedTuple):
    """The engine's threads on the cores."""

    big: int  # threads on big cores
    little: int  # ... and on little ones
    speed: float  # big-core equivalents at f_max

    def share(self, cores: int, background: float) -> float:
        """Each engine thread's share of a core while it runs beside `background` cores' worth of other work."""
        runnable = self.big + self.little + background
        return 1.0 if runnable <= cores else cores / runnable


UNPLACED = Placement(0, 0, 0.0)


def place(cpu: CpuSpec, threads: int, affinity: tuple[int, ...] | None, barrier_efficiency: float) -> Placement:
    """Threads on cores: big first among the CPUs allowed (CPUs 0..big-1 are big, as the snapshot's clusters say).
    More threads than allowed CPUs share them: each runs a share of a core and waits at every step's barrier for the
    descheduled ones (`barrier_efficiency`, as beside another process)."""
    big_cores = cpu.cores - cpu.little_cores
    allowed = range(cpu.cores) if affinity is None else [c for c in affinity if 0 <= c < cpu.cores]
    big_ok = sum(c < big_cores for c in allowed) or (0 if allowed else big_cores)
    little_ok = len(allowed) - sum(c < big_cores for c in allowed) if allowed else cpu.little_cores
    big = min(threads, big_ok)
    little = min(threads - big, little_ok)
    placed = big + little
    pace = cpu.little_speed if little else 1.0
    crowded = 1.0 if threads <= placed else placed / threads * barrier_efficiency
    return Placement(big, little, threads * pace * crowded)


def prefill_rate(
    compute: float, tier: SimModelSpec, efficiency: float, reread_s: float, n_batch: int
) -> tuple[float, float]:
    """(prompt tokens/s, of which computing) with `compute` big-core equivalents at f_max working on it."""
    computing = rate = compute * tier.prefill_thread_tok_s * efficiency
    if reread_s:
        rate = 1.0 / (1.0 / rate + reread_s / n_batch)
    return rate, computing


def decode_rate(
    compute: float, tier: SimModelSpec, *, bandwidth_gb_s: float, bytes_per_token: float, slowdown: float,
    reread_s: float,
) -> tuple[float, float]:  # fmt: skip
    """(decode tokens/s without the rate cap, of which computing): compute or memory bandwidth, the lesser."""
    bandwidth = bandwidth_gb_s * 1e9 / bytes_per_token
    computing = limit = min(compute * tier.thread_tok_s, bandwidth * slowdown)
    if reread_s:
        limit = 1.0 / (1.0 / limit + reread_s)
    return limit, computing
