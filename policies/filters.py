"""Small stateful filters the state machine is built from: a debounced trigger, a slope forecast, a busy window.

All take the time as an argument (no clock of their own) and keep their state in the object.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class Trigger:
    """A condition that turns on after holding `enter_s` and off after being gone `exit_s` (thermald's debounce).

    The caller passes the raw condition already evaluated with hysteresis (entry test while off, stay test while on).
    """

    enter_s: float
    exit_s: float
    on: bool = False
    since: float | None = None  # when the raw condition last started to disagree with `on`

    def update(self, raw: bool, t: float) -> bool:
        if raw == self.on:
            self.since = None
            return self.on
        if self.since is None:
            self.since = t
        if t - self.since >= (self.enter_s if raw else self.exit_s):
            self.on = raw
            self.since = None
        return self.on

    @property
    def pending(self) -> bool:
        return self.since is not None


@dataclass(slots=True)
class Forecast:
    """Least-squares line over the last `window_s` of (t, temp); predicts `horizon_s` ahead.

    Noise guard: the fit uses every point in the window (one noisy reading moves the slope little), needs
    `min_points`, never forecasts below the latest reading (cooling is not acted on early) and never more than
    `max_rise_c` above it (a glitch cannot fake an emergency).

    Running sums keep a tick O(1) (a full re-fit of 80 points was half the tick's cost); they are rebuilt from the
    points every `REBASE` additions, relative to the oldest point, so rounding cannot drift.
    """

    REBASE = 256

    window_s: float
    horizon_s: float
    min_points: int
    max_rise_c: float
    points: deque[tuple[float, float]] = field(default_factory=deque)
    origin: float = 0.0
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # x, y, xx, xy with x = t - origin
    adds: int = 0

    def add(self, t: float, temp_c: float) -> None:
        if not self.points:
            self.origin, self.sums, self.adds = t, [0.0, 0.0, 0.0, 0.0], 0
        self.points.append((t, temp_c))
        self._accumulate(t, temp_c, 1.0)
        while self.points and self.points[0][0] < t - self.window_s:
            old_t, old_y = self.points.popleft()
            self._accumulate(old_t, old_y, -1.0)
        self.adds += 1
        if self.adds >= self.REBASE:
            self._rebase()

    def _accumulate(self, t: float, y: float, sign: float) -> None:
        x = t - self.origin
        sums = self.sums
        sums[0] += sign * x
        sums[1] += sign * y
        sums[2] += sign * x * x
        sums[3] += sign * x * y

    def _rebase(self) -> None:
        self.adds = 0
        self.origin = self.points[0][0] if self.points else 0.0
        self.sums = [0.0, 0.0, 0.0, 0.0]
        for t, y in self.points:
            self._accumulate(t, y, 1.0)

    def clear(self) -> None:
        self.points.clear()
        self._rebase()

    def slope(self) -> float | None:
        """°C per second, or None with too few points."""
        n = len(self.points)
        if n < self.min_points:
            return None
        sx, sy, sxx, sxy = self.sums
        den = n * sxx - sx * sx
        if den <= 1e-12 * max(1.0, n * sxx):
            return None
        return (n * sxy - sx * sy) / den

    def predict(self, temp_c: float, slope: float | None) -> float:
        """`temp_c` (the latest reading) carried `horizon_s` ahead along the fitted slope."""
        if slope is None or slope <= 0:
            return temp_c
        return temp_c + min(slope * self.horizon_s, self.max_rise_c)


@dataclass(slots=True)
class BusyWindow:
    """Fraction of the last `window_s` seconds the engine was busy; each tick's state counts until the next tick."""

    window_s: float
    spans: deque[tuple[float, float, bool]] = field(default_factory=deque)  # (start, end, busy)
    last: tuple[float, bool] | None = None
    busy_s: float = 0.0

    def add(self, t: float, busy: bool) -> None:
        if self.last is not None and t > self.last[0]:
            start, was_busy = self.last
            self.spans.append((start, t, was_busy))
            if was_busy:
                self.busy_s += t - start
        self.last = (t, busy)
        horizon = t - self.window_s
        while self.spans and self.spans[0][1] <= horizon:
            start, end, was_busy = self.spans.popleft()
            if was_busy:
                self.busy_s -= end - start

    def fraction(self, t: float) -> float:
        """Busy seconds in (t - window_s, t] over window_s (a partly-covered window counts its gap as idle)."""
        horizon = t - self.window_s
        busy = self.busy_s
        if self.spans and self.spans[0][0] < horizon and self.spans[0][2]:
            busy -= horizon - self.spans[0][0]  # the oldest span straddles the window's start
        return max(0.0, min(1.0, busy / self.window_s))
