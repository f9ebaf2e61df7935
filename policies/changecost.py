"""What an engine reconfiguration costs, predicted, and how long a setting must have lasted to be worth changing.

A change between tokens (threads, the rate cap) costs nothing but a decision; a new context (n_ctx, n_batch) costs
building it (`context_s`) and copying the cache; a new KV type evaluates the conversation again at the engine's
prompt speed; a new model also reads its weights. The price is in seconds of answers not decoded (docs/policies.md,
"Every change has a price"); a change is made only once the setting in force has lasted `amortize` times the price
of leaving it (its cost is then a small share of the time it bought), and at least `live_dwell_s`; a model switch
at most once per `model_dwell_s`. A change that prevents a kill, a trip or a stall is urgent and pays any price.

`ChangeGate` applies it for the state machine: it remembers when the settings last changed and lets through what
has paid. Pure, like the rest of the policy: configurations and figures in, a price out. The lab's reconfiguration model
(governor/lab/engine.py) follows the same rules, so the price is what the lab charges.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from policies.decision import EngineConfig, KvType
from policies.memfit import ModelFootprint
from policies.schema import Changes
from sensors.snapshot import EngineObservation

MIB = 1 << 20
DECODE_PRIOR_TOK_S = 5.0  # the price's decode rate before the engine has reported one


@dataclass(frozen=True, slots=True)
class Rates:
    """The figures a price is computed from (measured where the engine reports them, else the policy's priors)."""

    prefill_tok_s: float  # prompt tokens the engine evaluates a second with the new setting
    load_mb_s: float  # reading a model's weights (page cache or storage)
    context_s: float = 0.3  # building a new context: KV cache and compute buffers


@dataclass(frozen=True, slots=True)
class Price:
    seconds: float  # answers not decoded meanwhile
    kind: str  # "live", "context", "re-evaluation" or "model"
    text: str  # for the why: "re-evaluating 1,800 tokens ≈ 12.0 s"


LIVE = Price(0.0, "live", "between tokens")


def price(
    old: EngineConfig, new: EngineConfig, *, context_tokens: int, rates: Rates, weights_bytes: Mapping[str, float]
) -> Price:
    """The predicted cost of going from `old` to `new` with `context_tokens` in the cache."""
    if not old.needs_reload(new):
        return LIVE
    # The cache is copied into a new context of the same model and KV type when it fits the new one; otherwise
    # the kept conversation (up to half the new context) is evaluated again, as the engine does.
    keep = min(context_tokens, new.n_ctx // 2)
    same_cache = old.model == new.model and old.kv_type == new.kv_type and context_tokens < new.n_ctx
    if same_cache:
        return Price(rates.context_s, "context", f"a new context ≈ {rates.context_s:.1f} s")
    reeval_s = keep / rates.prefill_tok_s if rates.prefill_tok_s > 0 else 0.0
    seconds = rates.context_s + reeval_s
    what = f"re-evaluating {keep:,} tokens"
    kind = "re-evaluation"
    if old.model != new.model:
        load_mb = weights_bytes.get(new.model, 0.0) / MIB
        seconds += load_mb / rates.load_mb_s
        what = f"loading {new.model} ({load_mb:,.0f} MiB) and {what}"
        kind = "model"
    return Price(seconds, kind, f"{what} ≈ {seconds:.1f} s")


@dataclass(frozen=True, slots=True)
class Dwell:
    """How long a setting lasts before a change that is not urgent: the policy's `[changes]` table."""

    live_s: float  # any change at all (threads, rate cap): at most 60 / live_s changes a minute
    amortize: float  # a change costing p seconds waits until the setting in force has lasted amortize x p
    model_s: float  # a model switch at most once per this

    def needed(self, p: Price) -> float:
        need = max(self.live_s, self.amortize * p.seconds)
        return max(need, self.model_s) if p.kind == "model" else need


class Build(Protocol):
    """Makes the engine config of these values (the state machine's cache of frozen configs)."""

    def __call__(
        self, threads: int, n_ctx: int, *, kv: KvType, model: str, rate: float | None, n_batch: int, pool: float
    ) -> EngineConfig: ...


class ChangeGate:
    """The policy's change gate: when the live settings, the reload settings and the model last changed, and which
    part of a wanted change has lasted long enough to pay its price."""

    def __init__(self, changes: Changes, footprints: Mapping[str, ModelFootprint]) -> None:
        self.changes = changes
        self.footprints = footprints
        self.dwell = Dwell(changes.live_dwell_s, changes.amortize, changes.model_dwell_s)
        self._live_t = self._reload_t = self._model_t = -math.inf
        self._switch_t = -math.inf  # the last model switch (not the first load)
        self.decode_tok_s: float | None = None  # the engine's last decode rate (the price's prefill prior)

    def model_waits(self, t: float) -> bool:
        """A model switch now would come sooner than `model_dwell_s` after the last one."""
        return self.changes.enabled and t - self._model_t < self.dwell.model_s

    def switch_waits(self, t: float) -> bool:
        """A model switch now would come sooner than `model_dwell_s` after the last switch (the first load aside)."""
        return self.changes.enabled and t - self._switch_t < self.dwell.model_s

    def price(self, prev: EngineConfig, want: EngineConfig, engine: EngineObservation | None) -> Price:
        ch = self.changes
        decode = self.decode_tok_s or DECODE_PRIOR_TOK_S
        rates = Rates(prefill_tok_s=decode * ch.prefill_ratio, load_mb_s=ch.load_mb_s, context_s=ch.context_s)
        fill = engine.context_tokens if engine is not None and engine.context_tokens is not None else 0
        weights = {name: float(fp.file_bytes) for name, fp in self.footprints.items()}
        return price(prev, want, context_tokens=fill, rates=rates, weights_bytes=weights)

    def admit(
        self, prev: EngineConfig | None, want: EngineConfig, *, urgent: tuple[bool, bool],
        engine: EngineObservation | None, t: float, build: Build,
    ) -> tuple[EngineConfig, str | None]:  # fmt: skip
        """Every change has a price: a change that is not urgent waits until the setting in force has lasted long
        enough to pay for it. `urgent`: (the live settings' change is, the reload settings' change is). Returns the
        config to apply and, when part of the wanted change waits, what waits and why (for the reason)."""
        if prev is None or want == prev or not self.changes.enabled:
            return self._applied(prev, want, t), None
        live_urgent, reload_urgent = urgent
        declined = []
        reload = (want.n_ctx, want.kv_type, want.model, want.n_batch)
        if prev.needs_reload(want) and not reload_urgent:
            p = self.price(prev, want, engine)
            need = self.dwell.needed(p) - (t - self._reload_t)
            if want.model != prev.model:
                need = max(need, self.dwell.model_s - (t - self._model_t))
            if need > 0:
                reload = (prev.n_ctx, prev.kv_type, prev.model, prev.n_batch)
                kept = {"n_ctx": prev.n_ctx, "kv_type": prev.kv_type, "model": prev.model, "n_batch": prev.n_batch}
                change = want.describe(want.model_copy(update=kept))
                declined.append(f"{change} waits {need:.0f} s: it would cost {p.text}")
        live = (want.threads, want.max_tokens_per_s)
        if live != (prev.threads, prev.max_tokens_per_s) and not live_urgent:
            need = self.dwell.live_s - (t - self._live_t)
            if need > 0:
                kept_live: dict[str, object] = {"threads": prev.threads, "max_tokens_per_s": prev.max_tokens_per_s}
                change = want.describe(want.model_copy(update=kept_live))
                declined.append(f"{change} waits {need:.0f} s (at most one change per {self.dwell.live_s:g} s)")
                live = (prev.threads, prev.max_tokens_per_s)
        if not declined:
            return self._applied(prev, want, t), None
        n_ctx, kv, model, n_batch = reload
        pool = want.lora_pool_mib  # the pool resizes between answers: no price, no dwell (it was reset to 0 here)
        config = build(live[0], n_ctx, kv=kv, model=model, rate=live[1], n_batch=n_batch, pool=pool)
        return self._applied(prev, prev if config == prev else config, t), "; ".join(declined)

    def _applied(self, prev: EngineConfig | None, config: EngineConfig, t: float) -> EngineConfig:
        """Note when the settings changed (the dwells count from there)."""
        if prev is not None and config == prev:
            return config
        self._live_t = t
        if prev is None or prev.needs_reload(config):
            self._reload_t = t
        if prev is None or prev.model != config.model:
            self._model_t = t
        if prev is not None and prev.model != config.model:
            self._switch_t = t
        return config
