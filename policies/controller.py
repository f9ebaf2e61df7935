"""The kernel power_allocator's PI law on a normalised output u in [0, 1] (1 = the hot profile's upper bounds).

    e = setpoint - T;  u = clamp(k·e + k_i·(I + e·dt))   with k = k_pu when e >= 0, k_po when e < 0

- Anti-windup: the integral only takes the new e·dt when the unclamped output lies inside [0, 1].
- Bumpless start: `start()` seeds I so that the output equals the level the engine is at (at once above the
  setpoint; at the setpoint when it starts below it, so the approach never sags under that level).
- Monotone: for one history (same I), a hotter reading gives a smaller or equal u, because u is `clamp` of a
  function increasing in e (both gains are positive) and the integral update does not feed back into this tick's u.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PIController:
    k_pu: float
    k_po: float
    k_i: float
    integral: float = 0.0  # °C·s
    bias: float = 0.0  # carries the bumpless start when k_i is 0 (a pure P controller)
    last_t: float | None = None
    max_dt_s: float = 5.0  # a gap in the ticks must not dump a minute of error into the integral

    @classmethod
    def with_defaults(
        cls, setpoint_c: float, switch_on_c: float, k_pu: float | None, k_po: float | None, k_i: float | None
    ) -> PIController:
        """Default gains as in power_allocator.rst: k_pu = 2·SP/(T_ctl - T_on), k_po = SP/(...), k_i = k_pu/10."""
        span = max(setpoint_c - switch_on_c, 0.5)
        pu = k_pu if k_pu is not None else 2.0 / span
        po = k_po if k_po is not None else 1.0 / span
        return cls(k_pu=pu, k_po=po, k_i=k_i if k_i is not None else pu / 10.0)

    def _p(self, error: float) -> float:
        return (self.k_pu if error >= 0 else self.k_po) * error

    def start(self, setpoint_c: float, temp_c: float, level: float, t: float) -> None:
        """Seed the integral. Above the setpoint the first output is `level` (bumpless). Below it the output at the
        setpoint is `level`: a seed that made only this tick's output equal `level` would leave the integral negative
        (it pays for the P term of an error that is about to shrink), and the output would sag under `level` on the
        way up to the setpoint, capping an engine the kernel would not yet throttle."""
        error = min(0.0, setpoint_c - temp_c)
        if self.k_i > 0:
            self.integral, self.bias = (level - self._p(error)) / self.k_i, 0.0
        else:
            self.integral, self.bias = 0.0, level - self._p(error)
        self.last_t = t

    def update(self, setpoint_c: float, temp_c: float, t: float) -> float:
        error = setpoint_c - temp_c
        dt = 0.0 if self.last_t is None else min(max(t - self.last_t, 0.0), self.max_dt_s)
        self.last_t = t
        candidate = self.integral + error * dt
        raw = self.bias + self._p(error) + self.k_i * candidate
        if 0.0 <= raw <= 1.0:
            self.integral = candidate
        return min(1.0, max(0.0, raw))
