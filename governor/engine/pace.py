"""When the answer's tokens left the engine: the rate cap's pace (each token held until 1/cap after the one before)
and the delivered rate the status shows; and the decode rate's moving average."""

from __future__ import annotations

import time
from collections import deque


class Emits:
    def __init__(self) -> None:
        self._at: deque[float] = deque(maxlen=64)  # monotonic times of the last tokens sent

    def mark(self) -> None:
        self._at.append(time.monotonic())

    def wait_s(self, cap: float) -> float:
        """Seconds until the next token may leave at `cap` tokens/s (<= 0: now; the first token never waits)."""
        return self._at[-1] + 1 / cap - time.monotonic() if self._at else 0.0

    def tokens_per_s(self, window_s: float = 2.0) -> float:
        """Tokens delivered per second over the last `window_s` (at most 64 tokens); 0 when fewer than 2 came."""
        now = time.monotonic()
        recent = [t for t in list(self._at) if now - t <= window_s]
        if len(recent) < 2:
            return 0.0
        return (len(recent) - 1) / max(recent[-1] - recent[0], 1e-9)


def ewma(rate: float | None, dt: float, alpha: float = 0.1) -> float:
    """The rate's moving average after one more event `dt` seconds long."""
    now = 1 / max(dt, 1e-9)
    return now if rate is None else (1 - alpha) * rate + alpha * now
