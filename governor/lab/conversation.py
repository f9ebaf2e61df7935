"""The conversation as the simulated engine holds it: the tokens in its KV cache, the conversation so far, and what
the next turn must evaluate again before its prompt (after a reload, or turns answered elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass

from governor.lab.workload import Request


@dataclass
class Conversation:
    ctx: float = 0.0  # tokens held in the KV cache
    history: float = 0.0  # tokens of the conversation so far (what a reload must evaluate again)
    pending: float = 0.0  # history to evaluate before the next prompt (after a reload)
    keep: float = 0.0  # the system prompt's tokens, which a context shift keeps

    def begin(self, request: Request, n_ctx: int) -> tuple[float, int]:
        """A local turn starts: the tokens it evaluates before its answer (its prompt, and what the cache lacks of the
        conversation after a reload or routed turns), and how many context shifts made room for it."""
        if request.new_conversation:
            self.ctx, self.history, self.pending = 0.0, 0.0, 0.0
            self.keep = float(request.system_tokens)
            return float(request.system_tokens + request.prompt_tokens), 0
        shifts = 0
        need = self.pending + request.prompt_tokens + request.answer_tokens
        if self.ctx and self.ctx + need > n_ctx:
            # prefix reuse: the cached part shifts (a warm swap's cache may lack the last turn's tail: `pending`)
            shifts = self.shift(need, n_ctx)
        if self.pending and self.ctx + need > n_ctx:
            # re-evaluating after a reload: nothing cached to shift, trim what is evaluated (n_keep/n_discard)
            self.pending = max(0.0, min(self.pending, n_ctx // 2 - self.ctx - request.prompt_tokens))
        prefill, self.pending = self.pending + request.prompt_tokens, 0.0
        return prefill, shifts

    def shift(self, need: float, n_ctx: int) -> int:
        """Context shift (llama-server's `--context-shift`): drop the older half of the cache after the kept system
        tokens (`llama_memory_seq_rm` + `llama_memory_seq_add`) until `need` more tokens fit; the rest stays cached.
        Returns how many shifts it took."""
        shifts = 0
        while self.ctx + need > n_ctx and self.ctx - self.keep >= 2:
            self.ctx -= (self.ctx - self.keep) // 2
            shifts += 1
        return shifts

    def pending_tokens(self) -> float:
        """Conversation tokens the next local turn must evaluate before its prompt (after a reload or routed turns)."""
        return self.pending

    def tokens(self) -> float:
        return self.history + self.pending

    def routed(self, request: Request) -> None:
        """A turn answered elsewhere: the conversation grew by it, and the next local turn evaluates it first."""
        turn = float(request.prompt_tokens + request.answer_tokens)
        if request.new_conversation:
            self.ctx, self.history = 0.0, 0.0
            self.keep = float(request.system_tokens)
            self.pending = request.system_tokens + turn
        else:
            self.pending += turn
        self.history += turn
