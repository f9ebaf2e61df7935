"""Threads on the cores a device really has: big.LITTLE clusters, x86 performance and efficiency cores.

llama.cpp splits every step of the graph evenly over its threads and waits for the slowest at the end of it, so n
threads on the n fastest cores decode at n x (the n-th fastest core's capacity) big-core equivalents: on a phone with
2 big cores and 6 little ones at 0.3 of a big core's pace, 4 threads give 4 x 0.3 = 1.2, fewer than 2 threads' 2.0,
and 8 give 2.4. `best(limit)` is the count at or under a limit with the most speed (within `TIE`, the fewer threads:
less power for the same tokens); `cpus(n)` the CPUs to place them on (the fastest first), for the affinity actuator.

Where the power budget binds (hot, no writable clock), the slowest cluster alone can be the better place: a little
core draws capacity² of a big one's power for capacity of its speed, so per token it costs a capacity's share (`slow`:
threads on the slowest cores only; issue 27's randomized phones: 6 little threads gave 1.17 x the ungoverned engine's
tokens at 0.66 x its J/token and no throttling, where hot's 2 big threads duty-cycled under a rate cap gave 0.57 x).

Power per core is not published per cluster: a core's share is taken as capacity² (a little core at 0.3 of a big
one's speed draws about a tenth of its power at the top clock: published A55 vs A7x per-core curves), an assumption
the device model's power fit corrects where a battery reports watts.

Pure: the snapshot's clusters in, counts out.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from sensors.snapshot import Cluster

TIE = 0.03  # counts within 3 % of the most speed: the fewest threads


class Cores:
    def __init__(self, clusters: Sequence[Cluster], count: int | None) -> None:
        caps = [c.capacity for c in clusters for _ in c.cpus]
        caps.sort(reverse=True)
        if count and len(caps) < count:  # CPUs no cluster lists (unknown): as fast as the fastest
            caps = [1.0] * (count - len(caps)) + caps
        self.caps = tuple(caps)
        self.clusters = tuple(clusters)
        self.alike = len(set(self.caps)) < 2
        low = self.caps[-1] if self.caps else 1.0
        # The slowest cores (0 where all are alike): the CPUs of the clusters at the lowest capacity, and that capacity
        self.slow_cpus = () if self.alike else tuple(sorted(c for k in clusters if k.capacity == low for c in k.cpus))
        self.slow_cap = low

    def speed(self, n: int, *, slow: bool = False) -> float:
        """Big-core equivalents of n threads on the n fastest cores, or on the slowest cluster alone (`slow`); more
        threads than cores: no faster."""
        if slow and self.slow_cpus:
            return min(n, len(self.slow_cpus)) * self.slow_cap if n > 0 else 0.0
        if self.alike or n <= 0:
            return float(n)
        k = min(n, len(self.caps))
        return k * self.caps[k - 1]

    def power(self, n: int, *, slow: bool = False) -> float:
        """Busy big-core equivalents of power of n threads (capacity² per core), on the slowest cluster if `slow`."""
        if slow and self.slow_cpus:
            return min(n, len(self.slow_cpus)) * self.slow_cap**2 if n > 0 else 0.0
        if self.alike or n <= 0:
            return float(n)
        return sum(c * c for c in self.caps[: min(n, len(self.caps))])

    def best(self, limit: int) -> int:
        """The thread count at most `limit` with the most speed; within TIE of it, the fewest threads."""
        if self.alike or limit <= 1:
            return limit
        return _best(self.caps, limit)

    def cpus(self, n: int, *, slow: bool = False) -> tuple[int, ...]:
        """The CPUs of the n fastest cores (whole clusters first), or the slowest cluster's (`slow`), for placing n
        threads; () when all are alike."""
        if self.alike:
            return ()
        if slow:
            return self.slow_cpus
        out: list[int] = []
        for cluster in self.clusters:  # fastest first
            out.extend(cluster.cpus)
            if len(out) >= n:
                break
        return tuple(sorted(out))


@cache
def _best(caps: tuple[float, ...], limit: int) -> int:
    speeds = [k * caps[k - 1] for k in range(1, min(limit, len(caps)) + 1)]
    top = max(speeds)
    return next(k for k, s in enumerate(speeds, start=1) if s >= top * (1 - TIE))
