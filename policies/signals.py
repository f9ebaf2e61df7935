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
    """

    window_s: float
    horizon_s: float
    min_points: int
    max_rise_c: float
    points: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, t: float, temp_c: float) -> None:
        self.points.append((t, temp_c))
        while self.points and self.points[0][0] < t - self.window_s:
            self.points.popleft()

    def clear(self) -> None:
        self.points.clear()

    def slope(self) -> float | None:
        """°C per second, or None with too few points."""
        n = len(self.points)
        if n < self.min_points:
            return None
        t0 = self.points[0][0]
        sx = sy = sxx = sxy = 0.0
        for t, y in self.points:
            x = t - t0
            sx += x
            sy += y
            sxx += x * x
            sxy += x * y
        den = n * sxx - sx * sx
        if den <= 1e-12:
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
