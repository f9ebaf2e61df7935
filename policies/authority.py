"""Heat the engine cannot govern: when hot's cut is at its floor and the kernel still throttles, step aside.

Hot's PI cuts the engine to keep the binding zone under its trip. Where the heat is other programs' (a busy phone's
skin held over its trip by them; issue 27's randomized fleet: the world alone throttled 56-74 % of the time), the cut
reaches its floor (one thread at hot's lowest rate) and the zone stays where they keep it: the kernel throttles the
clock anyway, for them and for the engine. The engine then pays twice, the kernel's throttling and the floor's cap
on top (fleet:1:19, busy machine: 1 tok/s for 12 minutes where `none` decoded 8 tok/s at the same throttled clock;
0.48 x its tokens). Governing never loses to nothing: after `WINDOW_S` at the floor with the kernel throttling and the
zone not falling by `FALL_C`, the hot limits step aside (pass-through; the kernel's throttling still keeps the trip,
as it does for `none`) until the kernel has not throttled for a back-off that doubles at each return
(`BACKOFF_S` .. `BACKOFF_MAX_S`), so a world that keeps the zone at its trip does not make the PI cut and release
every few minutes. Where the engine's own heat put the zone there, the cut has authority and the zone falls: no
step aside.

Hot also yields to the kernel where its clock steps are predicted to beat hot's cut (`yield_to_kernel`, from
policies/hot.py: alike cores whose clock cannot be set); the way back is the same.

Pure: readings and time in, a verdict out.
"""

from __future__ import annotations

from typing import NamedTuple

FLOOR_U = 0.02  # the PI output at which hot's cut is at its floor
WINDOW_S = 60.0  # that long at the floor with the kernel throttling and the zone not falling: not the engine's heat
FALL_C = 0.5  # ... by this much over the window (a falling zone: the cut is working, slowly)
BACKOFF_S = 120.0  # after stepping aside: back only when the kernel has not throttled this long
BACKOFF_MAX_S = 960.0  # ... doubling at each return, up to this


class Aside(NamedTuple):
    """Hot stepped aside: back after `back_s` without throttling; `kernel`: for the kernel's clock steps, the tokens/s
    predicted for hot's limits and for the kernel's (policies/hot.py `_kernel`), else for others' heat."""

    back_s: float
    kernel: tuple[float, float] | None = None
    over: bool = False  # ... the kernel's at its lowest clock over the trip, where hot's clock holds it (hot.losing)


class Authority:
    def __init__(self) -> None:
        self._since: float | None = None  # at the floor with the kernel throttling since
        self._start_c: float | None = None  # the zone's temperature then
        self.aside_t: float | None = None  # stepped aside at (None: hot governs)
        self._calm_t: float | None = None  # aside, and the kernel not throttling since
        self.backoff_s = BACKOFF_S
        self.kernel: tuple[float, float] | None = None  # stepped aside for the kernel's clock steps (see `Aside`)
        self._over = False

    @property
    def back_after_s(self) -> float | None:
        """Stepped aside: how long without throttling brings hot's limits back; else None."""
        return self.backoff_s if self.aside_t is not None else None

    @property
    def note(self) -> Aside | None:
        return Aside(self.backoff_s, self.kernel, self._over) if self.aside_t is not None else None

    def yield_to_kernel(self, t: float, governed: float, kernel: float, *, over: bool = False) -> None:
        """Step aside now: the kernel's clock steps are predicted to decode `kernel` tokens/s within the power hot's
        limits allow (`over`: at its lowest clock, over the trip), where those limits decode `governed` (back as after
        others' heat)."""
        self.aside_t, self._calm_t, self.kernel, self._over = t, None, (governed, kernel), over

    def aside(
        self, t: float, *, hot: bool, u: float | None, throttled: bool | None, temp_c: float | None,
        trip_c: float | None = None, held: bool = False,
    ) -> bool:  # fmt: skip
        """Whether hot's limits step aside this tick (`u`: the PI's last output; `throttled`: the kernel holds the
        clock down; None: unknown, never a reason to step aside; `trip_c`: the zone's trip: a zone more than `FALL_C`
        under it is not held at its trip by others, the kernel's step is only waiting out its hysteresis; `held`: others
        want every core and no clock can be set)."""
        if not hot:  # out of hot: the back-off starts over
            self._since = self._start_c = self.aside_t = self._calm_t = self.kernel = None
            self.backoff_s = BACKOFF_S
            return False
        if held:  # aside now; the way back starts when others no longer want every core, so the kernel, not a PI
            # restarting into the heat they left, takes the zone back down
            self.aside_t, self._calm_t, self.kernel = self.aside_t if self.aside_t is not None else t, None, None
            return True
        if self.aside_t is not None:
            if throttled is not False:
                self._calm_t = None
            elif self._calm_t is None:
                self._calm_t = t
            if self._calm_t is None or t - self._calm_t < self.backoff_s:
                return True
            self.aside_t = self._calm_t = self._since = self.kernel = None  # back: the PI starts from the power in use
            self.backoff_s = min(2 * self.backoff_s, BACKOFF_MAX_S)
            return False
        under = trip_c is not None and temp_c is not None and temp_c < trip_c - FALL_C
        if u is None or u > FLOOR_U or throttled is not True or temp_c is None or under:
            self._since = self._start_c = None
            return False
        if self._since is None or self._start_c is None or temp_c <= self._start_c - FALL_C:
            self._since, self._start_c = t, temp_c  # (again:) falling means the cut works
            return False
        if t - self._since < WINDOW_S:
            return False
        self.aside_t = t
        return True
