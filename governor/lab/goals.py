"""Issue 27's "Done when", judged per cell: one device x one workload, the governed run beside `none` (the ungoverned
engine) and the world alone (the same device and workload with nothing asked: what no engine setting can take away).

`bench/lab_fleet.py` prints the distribution of every goal over a fleet; the suite's property test judges a seeded
sample with the same functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from governor.lab.experiment import Summary

WIN_THROTTLED_PCT = 5.0  # `none` throttled more than this (or killed): the world leaves something to win
FAILED_SHARE = 0.05  # more of the questions asked than this failed: the p95 time to first token is unbounded


@dataclass(frozen=True)
class Cell:
    device: str
    workload: str
    governed: Summary
    none: Summary
    world: Summary

    @property
    def winnable(self) -> bool:
        """The ungoverned engine is throttled > 5 % of the time, loses answers to OOM kills or shuts the device down."""
        n = self.none
        return n.throttled_pct > WIN_THROTTLED_PCT or n.oom_kills > 0 or n.shutdown_s is not None

    @property
    def judged(self) -> bool:
        """Not where the world alone shuts the device down: its other programs take a zone to its critical trip
        whatever the engine runs (a build on a board that cannot hold it even at the kernel's deepest step)."""
        return self.world.shutdown_s is None

    @property
    def none_survives(self) -> bool:
        return self.none.oom_kills == 0 and self.none.failed == 0 and self.none.shutdown_s is None


@dataclass(frozen=True)
class Goal:
    name: str
    target: str  # the goal as printed
    value: Callable[[Cell], float | None]  # None: the goal does not apply to this cell
    ok: Callable[[float], bool]
    worst: Callable[[Sequence[float]], float]  # the direction a miss lies in (min or max)


def _tokens(c: Cell) -> float | None:
    if c.none.tokens <= 0:
        return None if c.governed.tokens <= 0 else float("inf")
    return c.governed.tokens / c.none.tokens


def _joules(c: Cell) -> float | None:
    """Not where `none` shut the device down: its joules stop there, the governed run's go on (idle included)."""
    g, n = c.governed.j_per_token, c.none.j_per_token
    return None if g is None or not n or c.none.shutdown_s is not None else g / n


def _ttft_p95(s: Summary) -> float | None:
    """p95 time to first token over every question asked: a failed answer never had a first token, so with more than
    5 % failed the p95 is unbounded (a `none` killed in most of a squeeze kept 8 answers of 28, its quickest: their
    p95 was no bound for the governed engine's 28); else the answered ones' (a little under the true p95)."""
    asked = s.answers + s.failed
    return math.inf if asked and s.failed > FAILED_SHARE * asked else s.ttft_p95_s


def _ttft(c: Cell) -> float | None:
    """p95 over the bound max(3 x its own p50, 1.2 x none's p95): at most 1.0."""
    g95, n95, g50 = _ttft_p95(c.governed), _ttft_p95(c.none), c.governed.ttft_p50_s
    if g95 is None or g50 is None:
        return None
    bound = max(3 * g50, 1.2 * n95 if n95 is not None else 0.0)
    if math.isinf(bound):
        return 0.0 if math.isfinite(g95) else None  # neither answered: the failures are the OOM goal's
    return g95 / bound if bound > 0 else None


def _at_most(bound: float) -> Callable[[float], bool]:
    return lambda v: v <= bound


GOALS: tuple[Goal, ...] = (
    Goal("tokens ÷ none", ">= 0.97", _tokens, lambda v: v >= 0.97, min),
    Goal("J/token ÷ none", "<= 1.02", _joules, _at_most(1.02), max),
    Goal(
        "throttled - world alone (points)",
        "<= 2",
        lambda c: c.governed.throttled_pct - c.world.throttled_pct,
        _at_most(2),
        max,
    ),
    Goal("config changes a minute", "<= 2", lambda c: c.governed.config_changes / c.governed.minutes, _at_most(2), max),
    Goal("model switches < 5 min apart", "0", lambda c: float(c.governed.model_changes_within_5min), _at_most(0), max),
    Goal(
        "OOM kills + failed answers (none survives)",
        "0",
        lambda c: float(c.governed.oom_kills + c.governed.failed) if c.none_survives else None,
        _at_most(0),
        max,
    ),
    Goal("TTFT p95 ÷ max(3 p50, 1.2 none p95)", "<= 1", _ttft, _at_most(1), max),
    Goal("critical shutdowns", "0", lambda c: float(c.governed.shutdown_s is not None), _at_most(0), max),
)
WIN_MEDIAN = 1.05  # tokens ÷ none, median over the winnable cells


@dataclass(frozen=True)
class Verdict:
    goal: Goal
    values: tuple[float, ...]
    misses: tuple[tuple[Cell, float], ...]  # worst first

    def quantiles(self) -> tuple[float, float, float, float, float]:
        """min, 5th percentile, median, 95th percentile, max (finite values)."""
        a = np.array([v for v in self.values if np.isfinite(v)] or [float("nan")])
        lo, p5, med, p95, hi = np.percentile(a, [0, 5, 50, 95, 100])
        return float(lo), float(p5), float(med), float(p95), float(hi)


def judge(cells: Sequence[Cell]) -> list[Verdict]:
    out = []
    for goal in GOALS:
        values, misses = [], []
        for c in filter(lambda c: c.judged, cells):
            v = goal.value(c)
            if v is None:
                continue
            values.append(v)
            if not goal.ok(v):
                misses.append((c, v))
        reverse = goal.worst is max
        misses.sort(key=lambda cv: cv[1], reverse=reverse)
        out.append(Verdict(goal, tuple(values), tuple(misses)))
    return out


def winnable_median(cells: Sequence[Cell]) -> tuple[int, float | None]:
    """(how many winnable cells, the median of their tokens ÷ none)."""
    ratios = [r for c in cells if c.judged and c.winnable and (r := _tokens(c)) is not None]
    return len(ratios), float(np.median(ratios)) if ratios else None


def misses(cell: Cell) -> list[str]:
    """The goals one cell misses, by name (none where it is not judged)."""
    out = []
    for goal in GOALS if cell.judged else ():
        v = goal.value(cell)
        if v is not None and not goal.ok(v):
            out.append(f"{goal.name} {v:.3g}")
    return out
