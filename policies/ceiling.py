"""No limit cycle in hot: a thread count that hot had to cut again soon after rising to it waits a back-off.

Hot's PI on a zone whose equilibrium power lies between two thread counts rises to the higher count whenever the zone
is under the setpoint, and cuts it again within seconds, once the zone is over it: a config change each way every half
minute (issue 27's randomized fleet: a 4-core laptop without a writable clock, where one thread holds the die under the
setpoint and two heat it past the trip, 4.8-7.2 changes a minute; a board whose lowest clock x 4 threads is over the
budget the zone sustains and x 3 under it, 2.7). A count that hot cut for heat (the zone at or over the setpoint) within
`RECENT_S` of the rise to it is over hot's ceiling for a back-off that doubles at each repeat (`BACKOFF_S` ..
`BACKOFF_MAX_S`, starting over after that long without one): the PI spends its output under it (the rate cap, the
clock) and the zone holds. When the back-off ends the count is tried again, so a world that cooled gets it back.

Pure: the threads in force, hot's own ask and time in; a ceiling out.
"""

from __future__ import annotations

import math

RECENT_S = 60.0  # a rise that hot had to undo this soon was a cycle, not a change of conditions
BACKOFF_S = 120.0  # the first ban's length
BACKOFF_MAX_S = 960.0  # ... doubling at each repeat up to this; that long without a ban and it starts over


class Ceiling:
    def __init__(self) -> None:
        self._threads: int | None = None  # the threads in force at the last tick in hot
        self._asked: int | None = None  # hot's own limit on them at that tick
        self._rose_t: float | None = None  # when the threads in force last rose
        self.most: int | None = None  # hot's threads at most (None: no ceiling)
        self.until = -math.inf  # the ceiling lasts until then
        self.backoff_s = BACKOFF_S

    def observe(self, t: float, threads: int | None, *, over_setpoint: bool) -> None:
        """The threads in force at this tick in hot (the config hot's last limit produced) and whether the zone is
        at or over the setpoint. A cut hot asked for, with the zone over the setpoint, soon after a rise: a ban."""
        last, asked, self._threads = self._threads, self._asked, threads
        if threads is None or last is None:
            return
        if threads > last:
            self._rose_t = t
        elif threads < last and asked is not None and asked < last and over_setpoint:
            if self._rose_t is not None and t - self._rose_t <= RECENT_S:
                if t - self.until > BACKOFF_MAX_S:  # quiet for long: the back-off starts over
                    self.backoff_s = BACKOFF_S
                self.most, self.until = last - 1, t + self.backoff_s
                self.backoff_s = min(2 * self.backoff_s, BACKOFF_MAX_S)
            self._rose_t = None

    def asked(self, threads: int | None) -> None:
        """Hot's own limit on the threads this tick (None: hot asked for none)."""
        self._asked = threads

    def limit(self, t: float) -> int | None:
        """Hot's threads at most now; None: no ceiling."""
        if self.most is not None and t >= self.until:
            self.most = None
        return self.most

    def note(self, t: float) -> tuple[int, float] | None:
        """(threads at most, for how long) for the why; None: no ceiling."""
        most = self.limit(t)
        return None if most is None else (most, self.until - t)

    def leave(self) -> None:
        """Out of hot: the next rise and cut are seen afresh (a ban in force lasts its time)."""
        self._threads = self._asked = self._rose_t = None
