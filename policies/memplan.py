"""The memory side of a tick: the budget, its bands, what memory pressure taught, and when to stop the engine.

- **Budget**: available + what the engine holds (a reload frees it) - the reserve; less counts at once, more only
  after it grew by `grow_margin_mb` and once per `recover_step_s` (input hysteresis).
- **Enter/exit bands**: a setting is left when it no longer fits the budget (exit) but a larger one is taken only
  when it fits with `grow_margin_mb` to spare (enter).
- **What pressure taught**: PSI memory pressure shrinks the setting a step at a time (`psi_shrink_fraction` per
  `psi_step_s`); the size that caused it becomes a ceiling that growth may not reach again until the budget has
  grown by a clear margin beyond the one it had then (a setting must be seen to fit, not only predicted to). Before
  this, the smaller setting left memory free, the larger one fitted on paper, and the engine swapped between them
  every few seconds (issue 27: 608 reconfigurations in 30 minutes on a phone).
- **Stop only when a kill is predicted**: when no setting fits the budget, the smallest one still runs if what the
  killer counts of it (its anonymous memory: KV cache, compute buffer, runtime; also the mapped weights where a
  userspace killer acts on pressure first, Android's lmkd) fits what the engine could hold before a kill, with
  `kill_margin_mb` to spare: slowly if its weights are re-read from storage, but answering. The engine stops only
  when even that would be killed.

Pure: readings and time in, a `Fit` out.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from policies.decision import KvType
from policies.memfit import MIB, Candidate, Fit, fit
from policies.schema import KV_ORDER, Memory, Timing
from sensors.snapshot import EngineObservation

FORECAST_S = 10.0  # memory that is falling counts this far ahead (ADPF's thermal forecast horizon)
FORECAST_WINDOW_S = 6.0  # ... at the slope over this long
SHRINK_BAND = 0.2  # a shrink goes to a setting that leaves this share of the budget free
BAND_FRACTION = 0.25  # growth back past a ceiling pressure set needs the budget this much (of the ceiling) larger


class MemoryPlan:
    def __init__(self, memory: Memory, timing: Timing, *, adapters: bool = False, switch_s: float = 0.0) -> None:
        self.cfg = memory
        self.adapters = adapters  # the ladder has LoRA adapters: every fit counts their pool (memfit.fit)
        self.timing = timing
        self.switch_s = switch_s  # a model switch lasts at least this long (the change price's model dwell)
        self._fall_rate = 0.0  # bytes a second other programs are taking (a sustained fall), this tick
        self._budget: float | None = None  # after input hysteresis
        self._budget_raw = 0.0  # ... before PSI's shrink
        self._budget_t = -math.inf
        self._pressure_cap: float | None = None  # bytes
        self._shrink_t = -math.inf
        self._ceiling: tuple[float, float] | None = None  # (bytes that caused pressure, the budget then)
        self.last: Fit | None = None
        self.before: Fit | None = None  # the setting in force when this tick's plan began
        self._rooms: deque[tuple[float, float]] = deque()  # (t, available + the engine's) over FORECAST_WINDOW_S
        self._cache: dict[tuple[int, int, str, int], Fit] = {}
        self.room: float | None = None  # what the engine could hold before a kill (available + its own), this tick
        self.budget: float | None = None  # what a setting may take this tick (after the reserve and PSI's shrink)
        self.budget_raw: float | None = None  # ... before PSI's shrink

    def kill_bytes(self, f: Fit, candidates: Sequence[Candidate], *, lmkd: bool) -> float:
        """What the killer counts of a setting: all of it under lmkd, else all but the mapped weights."""
        if lmkd:
            return f.bytes
        weights = next((c.footprint.file_bytes for c in candidates if c.name == f.model), 0)
        return f.bytes - weights

    def kill_predicted(self, f: Fit | None, candidates: Sequence[Candidate], *, lmkd: bool) -> bool:
        """Running `f` now would meet the killer (the room this tick, less `kill_margin_mb`)."""
        if f is None or self.room is None:
            return False
        return self.kill_bytes(f, candidates, lmkd=lmkd) > self.room - self.cfg.kill_margin_mb * MIB

    def plan(
        self,
        candidates: Sequence[Candidate],
        *,
        start: int,
        n_ctx: int,
        kv: KvType,
        available: int | None,
        engine: EngineObservation | None,
        pressure: bool,
        lmkd: bool,
        t: float,
    ) -> Fit:
        """The largest setting the profiles allow that fits (see the module's docstring)."""
        mem = self.cfg
        ctx = n_ctx
        self.before = self.last
        if available is None:
            self.room = None
            budget = None
        else:
            budget = self._budget_now(available, engine, pressure, t)
            self.room = available + self._in_use(engine)
        self.budget = budget
        self.budget_raw = None if budget is None else self._budget_raw
        key = (start, ctx, kv, -1 if budget is None else int(budget // MIB))
        result = self._cache.get(key)
        if result is None:
            if len(self._cache) > 4096:
                self._cache.clear()
            result = self._cache[key] = fit(
                candidates,
                max_ctx=ctx,
                kv_type=kv,
                budget_bytes=None if budget is None else key[3] * MIB,
                memory=mem,
                adapters=self.adapters,
            )
        if budget is not None and result.wait is None:
            result = self._banded(result, candidates, ctx, kv, budget)
            last = self.last
            if last is not None and last.wait is None and last.bytes > budget:
                # Leaving a setting that no longer fits (the exit band): to one with SHRINK_BAND of the budget to
                # spare, so that memory still falling (other programs allocate over seconds) takes one step, not one
                # reload per tick.
                result = self._leaving(result, candidates, ctx, kv, budget)
        if result.wait is not None and budget is not None and budget < self._budget_raw:
            # Only PSI's shrink is short of room: run the smallest setting that fits rather than stop (stopping ends
            # the pressure, which would start the engine again: a stop/start loop).
            smallest = self._smallest(candidates, self._budget_raw)
            if smallest.wait is None:
                result = smallest
        if result.wait is not None and self.room is not None:
            result = self._runs_anyway(result, candidates, lmkd=lmkd)
        if result.wait is None:
            result = self._held(result, candidates, engine, lmkd=lmkd)
        self.last = result
        return result

    def _held(
        self, result: Fit, candidates: Sequence[Candidate], engine: EngineObservation | None, *, lmkd: bool
    ) -> Fit:
        """What the engine holds now beyond any setting's plan (a warm build's second context while memory falls) is
        about to meet the killer: the engine pauses (which frees it) and starts again with `result` at the next
        tick, rather than be killed mid-answer. What the killer counts: the engine's anonymous memory (all of it
        under lmkd)."""
        if self.room is None or engine is None or engine.rss_bytes is None:
            return result
        held = engine.rss_bytes if lmkd or engine.anon_bytes is None else engine.anon_bytes
        if lmkd is False and engine.anon_bytes is None:  # the mapped weights may be partly out: at least this
            held -= next((c.footprint.file_bytes for c in candidates if c.name == engine.model), 0)
        if held <= self.room - self.cfg.kill_margin_mb * MIB:
            return result
        why = f"the engine holds {held / MIB:.0f} MiB the kernel cannot reclaim, {self.room / MIB:.0f} MiB left: "
        return replace(result, held=why + "paused before a kill")

    def within(self, candidates: Sequence[Candidate], *, n_ctx: int, kv: KvType) -> Fit | None:
        """The largest setting of these tiers that fits this tick's budget; if only PSI's shrink is short of room,
        their smallest setting that fits the budget without it; else None."""
        if not candidates or self.budget is None:
            return None
        found = fit(
            candidates, max_ctx=n_ctx, kv_type=kv, budget_bytes=self.budget, memory=self.cfg, adapters=self.adapters
        )
        last = self.last = self.before  # the plan's choice is not taken: the setting in force is the one left
        if found.wait is None and last is not None and last.wait is None and last.bytes > self.budget:
            found = self._leaving(found, candidates, n_ctx, kv, self.budget)  # the exit band, as in plan()
        if found.wait is not None and self.budget_raw is not None and self.budget_raw > self.budget:
            found = self._smallest(candidates, self.budget_raw)
        if found.wait is not None and self.room is not None:
            # Not even its smallest setting fits the budget: it runs on the reserve while the whole of it (weights
            # too: no re-reading them from storage at every token) fits what is left before a kill; else None.
            smallest = self._smallest(candidates, found.budget_bytes or 0.0)
            if smallest.bytes <= self.room - self.cfg.kill_margin_mb * MIB:
                found = replace(smallest, bound="below its footprint")
        if found.wait is not None:
            return None
        self.last = found
        return found

    def _leaving(self, result: Fit, candidates: Sequence[Candidate], ctx: int, kv: KvType, budget: float) -> Fit:
        """The exit band: leaving a setting that no longer fits, go where memory is going, in one step rather than one
        reload per tick behind it (other programs allocate over seconds to a minute):

        - to a setting with SHRINK_BAND of the budget to spare; where no setting of `result`'s tier has that, to the
          tier's smallest setting (it is where a falling budget ends);
        - a smaller tier only where memory is still falling: the tier that still fits if it falls on for as long as a
          model switch must last (`switch_s`), so that a fall takes one switch, not one per tier."""
        mem = self.cfg
        spare_budget = budget * (1 - SHRINK_BAND)
        spare = fit(candidates, max_ctx=ctx, kv_type=kv, budget_bytes=spare_budget, memory=mem, adapters=self.adapters)
        if spare.wait is None:
            result = spare
        else:
            tier = [c for c in candidates if c.name == result.model]
            smallest = self._smallest(tier, budget) if tier else result
            if smallest.wait is None and smallest.bytes < result.bytes:
                result = smallest
        last, names = self.last, [c.name for c in candidates]
        if last is None or last.model == result.model or self.switch_s <= FORECAST_S:
            return result
        if self._fall_rate * FORECAST_WINDOW_S < mem.grow_margin_mb * MIB:
            return result  # no fall, or one within MemAvailable's noise: extrapolated over minutes it would be a tier
        far = spare_budget - self._fall_rate * (self.switch_s - FORECAST_S)
        lasting = fit(candidates, max_ctx=ctx, kv_type=kv, budget_bytes=far, memory=mem, adapters=self.adapters)
        name = lasting.model if lasting.wait is None else names[-1]
        if result.model not in names or names.index(name) <= names.index(result.model):
            return result
        lower = candidates[names.index(name) :]
        for room in (spare_budget, budget):
            found = fit(lower, max_ctx=ctx, kv_type=kv, budget_bytes=room, memory=mem, adapters=self.adapters)
            if found.wait is None:
                return found
        return self._smallest(lower, budget)

    def smallest(self, candidates: Sequence[Candidate]) -> Fit:
        """The smallest setting of these tiers' last, against this tick's budget."""
        return self._smallest(candidates, self.budget if self.budget is not None else math.inf)

    def _smallest(self, candidates: Sequence[Candidate], budget: float) -> Fit:
        """The smallest setting there is (smallest tier and context, most compact KV, smallest n_batch: a 150k-token
        vocabulary's compute buffer at n_batch 512 outweighs a 2048-token KV cache), as fitting `budget` or not."""
        mem, last = self.cfg, candidates[-1]
        kv: KvType = KV_ORDER[-1] if last.flash_attn and last.footprint.quantized_kv_ok else "f16"
        ctx = min(mem.min_ctx, last.max_ctx)
        pool = mem.min_lora_pool_mib * MIB if self.adapters else 0.0  # the pool at its floor
        size = last.footprint.total_bytes(ctx, kv, mem, mem.min_n_batch) + pool
        bound = "memory" if size <= budget else "nothing fits"
        return Fit(last.name, ctx, kv, size, bound, "", budget, mem.min_n_batch, pool_bytes=pool)

    def _runs_anyway(self, nothing: Fit, candidates: Sequence[Candidate], *, lmkd: bool) -> Fit:
        """Nothing fits the budget: the smallest setting runs if the killer would leave it alone; else the engine
        waits, as before."""
        smallest = self._smallest(candidates, nothing.budget_bytes or 0.0)
        below = Fit(smallest.model, smallest.n_ctx, smallest.kv_type, smallest.bytes, "below its footprint",
                    nothing.note, nothing.budget_bytes, smallest.n_batch, pool_bytes=smallest.pool_bytes)  # fmt: skip
        return nothing if self.kill_predicted(below, candidates, lmkd=lmkd) else below

    def _banded(self, result: Fit, candidates: Sequence[Candidate], ctx: int, kv: KvType, budget: float) -> Fit:
        """Enter band: grow past the setting in force only with grow_margin_mb to spare; and never back to a size
        pressure stopped until the budget has grown by a clear margin since."""
        mem, last = self.cfg, self.last
        ceiling = self._ceiling
        if ceiling is not None:
            size, then = ceiling
            if budget >= then + max(mem.grow_margin_mb * MIB, BAND_FRACTION * size):
                self._ceiling = None  # memory really grew: the size may be tried again
            elif result.bytes >= size:
                capped = fit(
                    candidates, max_ctx=ctx, kv_type=kv, budget_bytes=size - MIB, memory=mem, adapters=self.adapters
                )
                result = capped if capped.wait is None else self._smallest(candidates, budget)
        if last is None or last.wait is not None or last.bytes > budget:
            return result
        tier = [c for c in candidates if c.name == last.model]
        if not tier:  # the profiles in force no longer allow its tier: the fit stands
            return result
        if last.n_ctx > ctx or KV_ORDER.index(last.kv_type) < KV_ORDER.index(kv):
            # The profiles now cap its context or KV type (heat): the band holds the setting in force as they cap it,
            # never a larger tier than it (the cap would otherwise let the fit jump past the band: hotter, bigger).
            last = fit(tier, max_ctx=min(last.n_ctx, ctx), kv_type=kv, budget_bytes=budget, memory=mem,
                       adapters=self.adapters)  # fmt: skip
            if last.wait is not None:
                return result
        if result.bytes <= last.bytes:
            return result
        # at least as much to spare as a shrink leaves (the exit band's target), or a shrink grows back at once
        margin = max(mem.grow_margin_mb * MIB, SHRINK_BAND * budget)
        spare = fit(
            candidates, max_ctx=ctx, kv_type=kv, budget_bytes=budget - margin, memory=mem, adapters=self.adapters
        )
        return spare if spare.wait is None and spare.bytes > last.bytes else last

    def _in_use(self, engine: EngineObservation | None) -> float:
        if engine is not None and engine.rss_bytes is not None:
            return float(engine.rss_bytes)
        if engine is not None and engine.model is not None and self.last is not None:
            return self.last.bytes  # a model is loaded but its size is not reported: our own estimate
        return 0.0

    def _falling(self, room: float, t: float) -> float:
        """Memory other programs are taking right now, forecast FORECAST_S ahead (their allocation ramps over
        seconds): counted against the budget at once, as the thermal forecast counts a rising temperature, so a
        shrink lands where the memory is going, not one reload per tick behind it. Only a sustained fall (both halves
        of the window falling) is extrapolated, at the slower half's pace: a step (a program that took its memory at
        once) is already all in the reading. Bytes (0 when not falling)."""
        window = self._rooms
        window.append((t, room))
        while window and t - window[0][0] > FORECAST_WINDOW_S:
            window.popleft()
        t0, r0 = window[0]
        self._fall_rate = 0.0
        if t - t0 < FORECAST_WINDOW_S / 2:
            return 0.0
        tm, rm = min(window, key=lambda tr: abs(tr[0] - (t0 + t) / 2))
        if not t0 < tm < t:
            return 0.0
        first, second = (r0 - rm) / (tm - t0), (rm - room) / (t - tm)
        self._fall_rate = max(0.0, min(first, second))
        return self._fall_rate * FORECAST_S

    def _budget_now(self, available: int, engine: EngineObservation | None, pressure: bool, t: float) -> float:
        """Bytes the engine may use: available + what the engine holds now (a reload frees it) - the reserve."""
        mem, timing = self.cfg, self.timing
        room = available + self._in_use(engine)
        budget = room - mem.reserve_mb * MIB - self._falling(room, t)
        # Input hysteresis: less memory counts at once, more only after it grew by a margin, once per step.
        if self._budget is None or budget < self._budget:
            self._budget = budget
        elif budget >= self._budget + mem.grow_margin_mb * MIB and t - self._budget_t >= timing.recover_step_s:
            self._budget, self._budget_t = budget, t
        budget = self._budget_raw = self._budget
        if not pressure:
            self._pressure_cap = None
        elif t - self._shrink_t >= mem.psi_step_s:  # shrink again while the pressure stays, one step at a time
            current = self.last.bytes if self.last is not None else budget
            self._pressure_cap = current * (1 - mem.psi_shrink_fraction)
            self._shrink_t = t
            if self.last is not None and self.last.wait is None:  # this size caused pressure: remember it
                low = self._ceiling[0] if self._ceiling is not None else math.inf
                self._ceiling = (min(low, self.last.bytes), budget)
        return budget if self._pressure_cap is None else min(budget, self._pressure_cap)
