"""The hot state's device model: the tokens/s and watts each configuration (threads x clock) is predicted to give.

Measured online (the formulas are `DeviceModel`'s): tokens/s from the engine's own counters at the configuration in
force, watts from a discharging battery's reading; until measured it uses the policy's prior (`[power]`, or a
`governor bench-device` TOML). Speed figures are the model's, kept per model; the watts are the device's. The allocator
(policies/allocator.py) scores its configurations with these predictions and decides when the model is taught
(`PowerAllocator.observe`). Pure and cheap: no I/O, no clock; an observation is a few dozen multiplications.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.cores import Cores
from policies.schema import Power

SPEED_DECAY = 0.998  # per observation: the peak tokens/s per thread·clock forgets slowly (context fill lowers it)
CEILING_GAIN = 0.2  # EWMA gain for the memory ceiling
CEILING_BELOW = 0.85  # an observation this far under the compute line is ceiling-limited
RATE_LIMITED = 0.9  # tokens/s at or above this share of the rate cap says nothing about the device
FLAT = 0.5  # a higher clock that gains less than half the compute line's gain over a lower one: memory-bound
RECENT_OBS = 240  # observations: how long a (threads, clock) figure counts as recent (clocks compared, probes)


class DeviceModel:
    """tokens/s = min(a·n·f, ceiling) and watts = idle + w·n·f^k·duty, with a, ceiling and (idle, w) learned; n in
    big-core equivalents of speed and of power where the cores differ (`set_cores`).

    The ceiling falls as the context fills: a memory-bound decode step reads all the weights and the KV cache of every
    token in the context, so tokens/s = bandwidth ÷ (weights + kv·fill) = ceiling at an empty context ÷ (1 + s·fill),
    s the KV bytes one context token adds per byte of weights (the model's header says both). The model keeps the
    empty-context ceiling: a Pi 5's 3B model decodes 12 % faster at a new conversation than at a full 2048-token one,
    and one ceiling learned at either end under- or over-predicts the other (`set_context`)."""

    def __init__(self, prior: Power) -> None:
        self.k = prior.freq_exponent
        self._prior_a = prior.thread_tok_s
        self.a: float | None = prior.thread_tok_s  # tokens/s of one thread at the top clock, compute-limited
        self.ceiling0: float | None = None  # tokens/s the memory allows at an empty context, once seen
        self._fill_scale = 1.0  # 1 + s·fill for the context in force: the ceiling now is ceiling0 ÷ this
        self.observations = 0
        self._grid_of: tuple[Sequence[float] | None, tuple[int, ...]] = (None, ())
        self._grid: tuple[tuple[int, float, float], ...] = ()
        # Recursive least squares on P = idle + w·x (x = n·f^k·duty), starting from the prior with low confidence.
        self._recent: dict[tuple[int, float], tuple[float, int]] = {}  # (threads, clock) -> (tok/s, observation no.)
        self._theta = [prior.idle_w, prior.core_w]
        self._cov = [[4.0, 0.0], [0.0, 1.0]]
        self.power_observations = 0
        self._model_name: str | None = None  # the engine's model these speed figures are of
        self._speeds: dict[str, tuple[float | None, float | None, dict[tuple[int, float], tuple[float, int]]]] = {}
        # The cores threads run on (policies/cores.py): n threads give cores.speed(n) one-big-core equivalents of
        # speed for cores.power(n) of power; on alike cores both are n. `a` is per big-core equivalent.
        self.cores = Cores((), None)

    def set_cores(self, cores: Cores) -> None:
        if cores.caps != self.cores.caps:
            self.cores = cores
            self._grid_of = (None, ())  # the loads change

    @property
    def ceiling(self) -> float | None:
        """tokens/s the memory allows at the context fill in force (None: not seen yet)."""
        return None if self.ceiling0 is None else self.ceiling0 / self._fill_scale

    def set_context(self, fill_tokens: float, kv_per_weight_byte: float) -> None:
        """The context fill in force (tokens in the KV cache) and the KV bytes a token adds per byte of weights
        (0: unknown, one ceiling for every fill)."""
        self._fill_scale = 1.0 + max(0.0, kv_per_weight_byte) * max(0.0, fill_tokens)

    @property
    def idle_w(self) -> float:
        return max(0.0, self._theta[0])

    @property
    def core_w(self) -> float:
        return max(0.05, self._theta[1])

    def switch_model(self, name: str) -> None:
        """Decode speed is the model's (tokens/s per thread and the memory ceiling: bandwidth ÷ its weights), the
        watts are the device's: keep the speed figures per model, so a tier change neither carries a 3B model's
        per-thread speed over to an 8B one (every 8B figure then looked ceiling-limited, and choosing for that ceiling
        lowered the clock, which lowered the ceiling) nor forgets what the model measured before."""
        if name == self._model_name:
            return
        if self._model_name is not None:
            self._speeds[self._model_name] = (self.a, self.ceiling0, self._recent)
        self._model_name = name
        self.a, self.ceiling0, self._recent = self._speeds.pop(name, (self._prior_a, None, {}))

    def load(self, threads: int, freq: float, *, slow: bool = False) -> float:
        return self.cores.power(threads, slow=slow) * math.pow(freq, self.k)

    def grid(self, threads: Sequence[int], ratios: Sequence[float]) -> tuple[tuple[int, float, float], ...]:
        """(threads, clock, load) for every clock x thread count, the fewest watts first (by load, then threads; equals
        in clock-major order): computed once per table and thread range (the allocator asks every tick; the clock
        table is the same tuple every time)."""
        key = (ratios, tuple(threads))
        if key[0] is not self._grid_of[0] or key[1] != self._grid_of[1]:
            cells = [(n, f, self.load(n, f)) for f in ratios for n in key[1]]
            self._grid_of, self._grid = key, tuple(sorted(cells, key=lambda c: (c[2], c[0])))  # stable
        return self._grid

    def speed(self, threads: int, freq: float, *, slow: bool = False) -> float:
        """Predicted decode tokens/s (`slow`: on the slowest cluster alone); in units of one thread at the top clock
        while `a` is unknown."""
        compute = (self.a or 1.0) * self.cores.speed(threads, slow=slow) * freq
        return compute if self.ceiling is None else min(compute, self.ceiling)

    def power_w(self, threads: int, freq: float, duty: float = 1.0) -> float:
        return self.power_at(self.load(threads, freq), duty)

    def power_at(self, load: float, duty: float = 1.0) -> float:
        return self.idle_w + self.core_w * load * duty

    def observe(
        self,
        threads: int,
        freq: float,
        tok_s: float | None,
        rate_cap: float | None,
        power_w: float | None,
        *,
        slow: bool = False,
    ) -> None:
        """One tick's measurement at the configuration in force (`freq` the clock the CPU actually ran at; `slow`: the
        threads ran on the slowest cluster alone)."""
        duty = 1.0
        if tok_s is not None and tok_s > 0 and threads > 0 and freq > 0:
            if rate_cap is not None and tok_s >= RATE_LIMITED * rate_cap:
                duty = min(1.0, tok_s / max(self.speed(threads, freq, slow=slow), 1e-9)) if self.a else 1.0
            else:
                self._observe_speed(threads, freq, tok_s, slow)
        if power_w is not None and math.isfinite(power_w) and 0 < power_w < 1000 and tok_s:
            self._observe_power(self.load(threads, freq, slow=slow) * duty, power_w)

    def _observe_speed(self, threads: int, freq: float, tok_s: float, slow: bool = False) -> None:
        self.observations += 1
        per = tok_s / (self.cores.speed(threads, slow=slow) * freq)
        if self.a is None or per >= self.a * SPEED_DECAY:
            self.a = per if self.a is None else max(per, self.a * SPEED_DECAY)
        else:
            self.a *= SPEED_DECAY
        if per < CEILING_BELOW * self.a:  # compute could do more: the memory is the limit here
            self._toward_ceiling(tok_s)
        elif self.ceiling0 is not None and tok_s * self._fill_scale > self.ceiling0:
            self.ceiling0 = tok_s * self._fill_scale
        if slow:  # the figures by (threads, clock) are of the fastest cores (clocks compared, probes)
            return
        key = (threads, round(freq, 4))
        old = self._recent.get(key)
        fresh = old is not None and self.observations - old[1] <= RECENT_OBS
        tok = old[0] + CEILING_GAIN * (tok_s - old[0]) if old is not None and fresh else tok_s
        self._recent[key] = (tok, self.observations)
        self._compare_clocks(threads, key[1], tok)

    def _toward_ceiling(self, tok_s: float) -> None:
        """A ceiling-limited figure at the context in force, kept as the empty context's."""
        empty = tok_s * self._fill_scale
        self.ceiling0 = empty if self.ceiling0 is None else self.ceiling0 + CEILING_GAIN * (empty - self.ceiling0)

    def _compare_clocks(self, threads: int, freq: float, tok: float) -> None:
        """A memory-bound decode never shows up as per-thread speed under the peak (`a` is only ever learned where it
        runs): compare clocks instead. If a higher clock gained less than half of what compute would give over a
        lower one at the same threads, recently, the memory is the limit from the lower clock on."""
        if len(self._recent) > 64:
            self._recent = {k: v for k, v in self._recent.items() if self.observations - v[1] <= RECENT_OBS}
        for (n, f), (other, at) in self._recent.items():
            if n != threads or f == freq or self.observations - at > RECENT_OBS:
                continue
            (lo_f, lo_t), (hi_f, hi_t) = sorted(((f, other), (freq, tok)))
            if hi_t < lo_t * (1 + FLAT * (hi_f / lo_f - 1)):
                self._toward_ceiling(max(lo_t, hi_t))

    def measured_below(self, threads: int, freq: float, tok_s: float) -> bool:
        """Recently measured at (threads, freq) and slower than tok_s: no need to try that clock again yet."""
        seen = self._recent.get((threads, round(freq, 4)))
        return seen is not None and self.observations - seen[1] <= RECENT_OBS and seen[0] < tok_s

    def _observe_power(self, x: float, watts: float) -> None:
        self.power_observations += 1
        (p00, p01), (p10, p11) = self._cov
        g0, g1 = p00 + p01 * x, p10 + p11 * x  # P·φ with φ = (1, x)
        denom = 0.99 + g0 + g1 * x  # forgetting factor 0.99: the device warms, the screen dims
        k0, k1 = g0 / denom, g1 / denom
        err = watts - (self._theta[0] + self._theta[1] * x)
        self._theta = [self._theta[0] + k0 * err, self._theta[1] + k1 * err]
        self._cov = [
            [(p00 - k0 * g0) / 0.99, (p01 - k0 * g1) / 0.99],
            [(p10 - k1 * g0) / 0.99, (p11 - k1 * g1) / 0.99],
        ]
