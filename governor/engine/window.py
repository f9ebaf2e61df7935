"""Which part of a long chat goes into the context, chosen so that the following turns reuse the KV cache.

Today's `chat.fit` drops as few old turns as it can: once a chat has outgrown the context, every new turn drops one
or two more, the prompt's beginning changes each time and nothing after the system message is reused (a full
re-prefill per turn). Here old turns go in a large chunk (about half of what could go, as llama.cpp server's
context shift discards half of what is after `n_keep`), and the same cut is kept for the following turns while they
fit: the prompt then grows only at its end, and the model's cache (`LoadedModel.reuse`) shifts the kept part into
place instead of evaluating it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from governor.engine.chat import FittedPrompt, PromptTooLong, Tokenizer

ContextShift = Literal["on", "reevaluate", "off"]  # `governor engine --context-shift`


def context_mode(shift: ContextShift, can_shift: bool) -> str:
    """How a chat that outgrew the context is handled now: "shift" (the kept part moves in the KV cache),
    "reevaluate" (chunked trim, the kept part evaluated again: asked for, or the model cannot shift) or "trim"
    (as few turns dropped as possible, re-evaluated each turn: `--context-shift off`)."""
    if shift == "off":
        return "trim"
    return "shift" if shift == "on" and can_shift else "reevaluate"


@dataclass(frozen=True)
class Cut:
    """The last chunked trim in this context: how many non-system messages went, and the first one kept (so a cut
    is only reused for the conversation it was made for)."""

    dropped: int
    first_kept: tuple[tuple[str, str], ...]


def _key(message: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(message.items()))


def fit_chunked(
    tok: Tokenizer,
    messages: Sequence[dict[str, str]],
    n_ctx: int,
    *,
    answer_room: int,
    last: Cut | None,
) -> tuple[FittedPrompt, Cut | None]:
    """The prompt for `messages` in `n_ctx` with `answer_room` to spare, and the cut to remember for the next turn.

    Leading system messages and the last message are always kept; older turns go whole (a turn starts at a user
    message). Raises PromptTooLong when even the kept messages do not fit.
    """
    n_system = 0
    while n_system < len(messages) - 1 and messages[n_system]["role"] in ("system", "developer"):
        n_system += 1
    head, rest = list(messages[:n_system]), list(messages[n_system:])
    usable = n_ctx - answer_room
    sizes: dict[int, list[int]] = {}

    def tokens_from(cut: int) -> list[int]:
        if cut not in sizes:
            sizes[cut] = tok.encode(tok.render(head + rest[cut:]), prompt=True)
        return sizes[cut]

    full = tokens_from(0)
    if len(full) <= usable:
        return FittedPrompt(full, 0), None
    cuts = sorted({c for c in range(1, len(rest)) if rest[c]["role"] == "user"} | {len(rest) - 1})
    start = 0
    if last is not None and last.dropped in cuts and _key(rest[last.dropped]) == last.first_kept:
        start = last.dropped
        if len(tokens_from(start)) <= usable:  # the same cut as the last turn: the same prompt beginning
            return FittedPrompt(tokens_from(start), start), last
    # A new cut, at least half of what could go from the current window (binary search: fewer renders).
    window = len(tokens_from(start))
    goal = window - (window - len(tokens_from(cuts[-1]))) // 2
    later = [c for c in cuts if c > start]
    lo, hi = 0, len(later) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        n = len(tokens_from(later[mid]))
        if n <= usable and n <= goal:
            hi = mid
        else:
            lo = mid + 1
    cut = later[lo] if later else start
    tokens = tokens_from(cut)
    if len(tokens) >= n_ctx:
        raise PromptTooLong(len(tokens), n_ctx)
    return FittedPrompt(tokens, cut), (Cut(cut, _key(rest[cut])) if cut else None)
