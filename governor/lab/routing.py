"""An upstream in the lab: a bigger machine the device may send a chat turn to (the daemon's routing, issue 12).

The decision is the daemon's: the policy's `[slo]` judged by `policies.slo.predict` from the decision and the
engine's measured speeds, with `RouteGate`'s hysteresis, plus the per-request time-to-first-token check. The
upstream serves each routed turn on its own: first token after `latency_s` plus the prefill, at
`prefill_tokens_per_s`, of what it has not seen of the conversation (it keeps a prefix cache, as llama.cpp's server
and vLLM do), then `tokens_per_s`; the device meanwhile idles but for its radio (`radio_w` while a stream is open).
The device's engine must evaluate the routed turns before its next local one (they are not in its KV cache), so
the per-request check tends to keep a conversation upstream once it went there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from governor.lab.engine import EngineSim
from governor.lab.workload import Request, UpstreamSpec
from policies.decision import Decision
from policies.schema import Policy
from policies.slo import Measured, RouteGate, predict


@dataclass
class Routed:
    request: Request
    first_token_s: float
    end_s: float


@dataclass
class UpstreamSim:
    spec: UpstreamSpec
    policy: Policy | None
    gate: RouteGate = field(default_factory=RouteGate)
    decision: Decision | None = None
    streams: list[Routed] = field(default_factory=list)
    answers: int = 0
    tokens: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    seen: float = 0.0  # conversation tokens in the upstream's prefix cache

    def on_tick(self, t: float, decision: Decision, engine: EngineSim) -> None:
        self.decision = decision
        if self.policy is None:
            return
        m = self.measured(engine)
        slo = self.policy.slo
        strict = predict(self.policy, decision, m)
        self.gate.update(t, slo, strict, predict(self.policy, decision, m, margin=slo.back_margin))

    @staticmethod
    def measured(engine: EngineSim) -> Measured:
        threads = engine.config.threads if engine.config is not None else None
        return Measured(engine.uncapped_tokens_per_s, threads, engine.prefill_tokens_per_s, threads)

    def wants(self, request: Request, engine: EngineSim) -> bool:
        """Send this turn upstream? (The device's engine restarting also counts, as in the daemon.)"""
        if self.policy is None or self.decision is None:
            return False
        if engine.config is None or not engine.loaded:
            return True
        if self.gate.off:
            return True
        prompt = request.prompt_tokens + round(engine.chat.pending_tokens())  # the routed turns are not in its cache
        return not predict(self.policy, self.decision, self.measured(engine), prompt).meets

    def submit(self, request: Request, t: float, context_tokens: float) -> None:
        """Route `request`, whose conversation so far is `context_tokens` long."""
        spec = self.spec
        if request.new_conversation or context_tokens < self.seen:
            self.seen = 0.0
        new = context_tokens - self.seen + request.prompt_tokens
        self.seen = context_tokens + request.prompt_tokens + request.answer_tokens
        first = t + spec.latency_s + new / spec.prefill_tokens_per_s
        end = first + request.answer_tokens / spec.tokens_per_s
        request.first_token_s = first
        self.ttft_s.append(first - t)
        self.streams.append(Routed(request, first, end))

    def step(self, t: float) -> list[float]:
        """Turns finished by `t` (their end times, for the chat driver)."""
        done = [s for s in self.streams if s.end_s <= t]
        if done:
            self.streams = [s for s in self.streams if s.end_s > t]
        for s in done:
            self.answers += 1
            self.tokens += s.request.answer_tokens
        return [s.end_s for s in done]

    def radio_w(self) -> float:
        return self.spec.radio_w if self.streams else 0.0
