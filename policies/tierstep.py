"""Hot steps down the model ladder where the power that keeps the trip leaves the tier in force far slower than the
ungoverned engine (rule `thermal.tier`).

On a device whose idle power alone holds the zone a few degrees under its trip (a board with a 3.8 W floor behind
14 K/W), hot's budget leaves the engine a fraction of a watt: two threads at the lowest clock. The kernel cannot hold
the trip there (its lowest clock x every thread is still over it), so the ungoverned engine runs 17 °C over the trip,
throttled all along, at four times the governed engine's tokens. No clock x threads x rate within the budget wins
that back (tokens/s and watts are both linear in threads at a clock); a smaller model decodes faster per watt, by
about its weights' ratio (each token reads every weight once).

The test, each tick in hot while the allocator runs (a writable clock) and the engine decodes: the budget's choice
decoding the tier in force, scaled by the weights (tier in force ÷ largest), against the largest tier at every thread
at the clock table's lowest step (the deepest the kernel's throttling takes the ungoverned engine). Under `LOSS` of
it for `HOLD_S` (the PI settles first), and a smaller tier is `GAIN` times faster by its weights: the largest tier
allowed steps one down. A bigger tier comes back when it would decode `BACK` times the ungoverned engine for
`HOLD_S`, or when hot ends. The model switch itself is priced and dwelled (policies/changecost.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

LOSS = 0.8  # step down when the tier in force decodes under this share of the ungoverned engine's estimate
BACK = 1.0  # a bigger tier comes back once it would decode this share of it
GAIN = 1.25  # only to a tier this much faster by its weights (a model load for a few percent is not worth it)
HOLD_S = 15.0  # the condition holds this long (the PI's budget of a moment is no reason to load a model)


class TierStep:
    """The largest tier hot allows (None: every tier), by the budget's speed against the ungoverned engine's."""

    def __init__(self, names: Sequence[str], weights: Mapping[str, float]) -> None:
        self.names = [n for n in names if weights.get(n, 0.0) > 0]  # largest first; tiers of unknown size: not used
        self.weights = {n: weights[n] for n in self.names}
        self.cap = 0  # index into names: the largest tier allowed
        self._down_t: float | None = None
        self._up_t: float | None = None
        self.share: float | None = None  # the tier in force's decode ÷ the ungoverned engine's (the last estimate)

    def leave(self) -> None:
        """Hot ended: every tier is allowed again (the switch back is priced like any other)."""
        self.cap, self._down_t, self._up_t, self.share = 0, None, None, None

    @property
    def limit(self) -> str | None:
        return self.names[self.cap] if self.cap > 0 else None

    def bottom(self, model: str) -> bool:
        """No smaller tier `GAIN` times faster than `model` to step down to."""
        if model not in self.weights:
            return True
        smaller = self.names[self.names.index(model) + 1 :]
        return not smaller or self.weights[model] < GAIN * self.weights[smaller[0]]

    def observe(self, t: float, model: str, budget_share: float) -> str | None:
        """`model`: the tier in force; `budget_share`: the budget's choice ÷ every thread at the lowest clock, both
        decoding that tier (a thread x clock ratio). Returns the largest tier allowed now (None: no limit)."""
        if model not in self.weights or len(self.names) < 2:
            return self.limit
        largest = self.weights[self.names[0]]
        share = self.share = budget_share * largest / self.weights[model]
        here = self.names.index(model)
        down = share < LOSS and not self.bottom(model)
        if not down:
            self._down_t = None
        elif self._down_t is None:
            self._down_t = t
        elif t - self._down_t >= HOLD_S:
            self.cap, self._down_t = max(self.cap, here + 1), None
        bigger = self.names[self.cap - 1] if self.cap > 0 else None
        up = bigger is not None and budget_share * largest / self.weights[bigger] >= BACK
        if not up:
            self._up_t = None
        elif self._up_t is None:
            self._up_t = t
        elif t - self._up_t >= HOLD_S:
            self.cap, self._up_t = self.cap - 1, None
        return self.limit
