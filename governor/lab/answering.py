"""The simulated engine's answers: the requests queued, the one in progress (its prompt tokens left to evaluate, its
answer tokens left and done, its adapter's stall), and when each ended or failed, for the chat driver.

A request starts as llama.cpp's server starts it: its adapter taken from the pool (a switch or a load stalls it; one
larger than the whole pool is refused), the conversation's cache evaluated again when it was another adapter's, then
shifted to make room (governor.lab.conversation); a prompt that alone does not fit fails, an answer that does not fit
is truncated. governor.lab.engine runs the answer (its speed, the settings' changes); this keeps its account.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from governor.lab.adapters import SimPool
from governor.lab.conversation import Conversation
from governor.lab.stats import EngineStats
from governor.lab.workload import Request


@dataclass
class Answering:
    stats: EngineStats
    queue: deque[Request] = field(default_factory=deque)
    current: Request | None = None
    prefill_left: float = 0.0
    answer_left: float = 0.0
    answer_done: float = 0.0  # tokens of the current answer so far
    stall: float = 0.0  # seconds the answer starting waits for its adapter (a switch, a load)
    finished: list[float] = field(default_factory=list)  # times answers ended (or failed), for the chat driver

    def next(self, now: float, n_ctx: int, pool: SimPool, chat: Conversation) -> None:
        """Start queued requests until one runs (or none is left)."""
        while self.queue and self.current is None:
            self._start(self.queue.popleft(), now, n_ctx, pool, chat)

    def _start(self, request: Request, now: float, n_ctx: int, pool: SimPool, chat: Conversation) -> None:
        adapter = pool.use(request.adapter)
        if adapter is None:  # larger than the whole pool: the engine answers 503
            self.failed(now)
            return
        self.stall, lost = adapter
        if lost and not request.new_conversation:  # the cache was the other adapter's: evaluated again
            chat.pending += chat.ctx
            chat.ctx = 0.0
        prefill, shifts = chat.begin(request, n_ctx)
        self.stats.shifts += shifts
        if chat.ctx + prefill >= n_ctx:
            self.failed(now)  # the prompt alone does not fit: llama.cpp raises ValueError
            return
        self.current = request
        self.prefill_left = prefill
        self.answer_left = min(float(request.answer_tokens), n_ctx - chat.ctx - prefill)
        self.answer_done = 0.0
        if self.answer_left < request.answer_tokens:
            self.stats.truncated += 1

    def decoded(self, done: float, now: float, rate: float, chat: Conversation) -> None:
        """`done` answer tokens decoded from `now` at `rate` tokens/s (the first one sets the time to first token)."""
        assert self.current is not None
        if self.current.first_token_s is None and done > 0:
            self.current.first_token_s = now + 1.0 / rate
            self.stats.ttft_s.append(self.current.first_token_s - self.current.arrival_s)
        self.answer_left -= done
        self.answer_done += done
        chat.ctx += done

    def ended(self, t: float, chat: Conversation) -> None:
        """The answer is complete at `t`: the conversation holds it."""
        chat.history = chat.ctx
        self.stats.answers += 1
        self.current = None
        self.finished.append(t)

    def failed(self, t: float) -> None:
        """A request failed at `t` without an answer (refused, too long, or the device is off)."""
        self.stats.failed += 1
        self.finished.append(t)

    def killed(self, t: float) -> None:
        """The process died at `t`: the answer in progress is lost (its client got an error mid-stream)."""
        if self.current is not None:
            self.stats.failed += 1
            self.stats.lost_tokens += self.answer_done
            self.current = None
            self.finished.append(t)
