"""What an engine reconfiguration costs, predicted, and how long a setting must have lasted to be worth changing.

A change between tokens (threads, the rate cap) costs nothing but a decision; a new context (n_ctx, n_batch) costs
building it (`context_s`) and copying the cache; a new KV type evaluates the conversation again at the engine's
prompt speed; a new model also reads its weights. The price is in seconds of answers not decoded (docs/policies.md,
"Every change has a price"); a change is made only once the setting in force has lasted `amortize` times the price
of leaving it (its cost is then a small share of the time it bought), and at least `live_dwell_s`; a model switch
at most once per `model_dwell_s`. A change that prevents a kill, a trip or a stall is urgent and pays any price.

Pure, like the rest of the policy: configurations and figures in, a price out. The lab's reconfiguration model
(governor/lab/engine.py) follows the same rules, so the price is what the lab charges.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from policies.decision import EngineConfig

MIB = 1 << 20


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
