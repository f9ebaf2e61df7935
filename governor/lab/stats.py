"""What the simulated engine counts (`EngineStats`, which a run's Summary reads) and its prompt evaluation speed per
n_batch (`batch_efficiency`); the speed model itself is governor.lab.speed's."""

from __future__ import annotations

from dataclasses import dataclass, field

BATCH_HALF = 32  # n_batch at which a step's fixed costs equal its per-token work (assumed, see batch_efficiency)


def batch_efficiency(n_batch: int) -> float:
    """Prompt evaluation speed at `n_batch` relative to llama.cpp's default 512: each step has a fixed cost (reading
    the weights once, the graph, the thread barrier) spread over the batch, b / (b + BATCH_HALF). An assumption, not
    a measurement: at 64 it gives 0.71, at 128 0.85, at 2048 1.05."""
    default = 512 / (512 + BATCH_HALF)
    return n_batch / (n_batch + BATCH_HALF) / default


@dataclass
class EngineStats:
    tokens: float = 0.0
    lost_tokens: float = 0.0  # of `tokens`, those of answers the kernel killed mid-stream (the client got an error)
    decode_s: float = 0.0
    prefill_tokens: float = 0.0
    answers: int = 0
    truncated: int = 0
    failed: int = 0
    oom_kills: int = 0
    starts: int = 0  # engine processes started: the first, after an OOM kill, after waiting for memory
    reloads: int = 0  # new KV cache: the conversation evaluated again
    restarts: int = 0  # llama-server restarted to change a setting (EngineSpec.kind = "llama-server")
    restores: int = 0  # of which its slot restored: the conversation kept without evaluating it again
    warm_swaps: int = 0  # of which built beside the answering context (governor.lab.swap)
    cold_why: list[str] = field(default_factory=list)  # why each KV type change mid-answer was not warm
    resizes: int = 0  # n_ctx changes that kept the cache
    shifts: int = 0  # context shifts (the oldest half of the cache dropped, the rest kept)
    ttft_s: list[float] = field(default_factory=list)
    rate_samples: list[tuple[float, float]] = field(default_factory=list)  # (tokens/s, seconds) while decoding
    window_tokens: float = 0.0  # decoded since the last take_rate() (the engine's stats endpoint)
    window_decode_s: float = 0.0

    def decoded(self, tokens: float, seconds: float, rate: float) -> None:
        """`tokens` decoded in `seconds` at `rate` tokens/s."""
        self.tokens += tokens
        self.decode_s += seconds
        self.window_tokens += tokens
        self.window_decode_s += seconds
        self.rate_samples.append((rate, seconds))

    def take_rate(self) -> float | None:
        """Mean decode tokens/s since the last call (what the engine's stats endpoint would report)."""
        if self.window_decode_s <= 0:
            return None
        rate = self.window_tokens / self.window_decode_s
        self.window_tokens = self.window_decode_s = 0.0
        return rate
