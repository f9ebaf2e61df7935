"""The worker -> event loop hand-off: tokens that pile up while the loop is busy leave as one SSE chunk."""

from __future__ import annotations

import asyncio
import json
import threading

from governor.engine.events import Ended, Text
from governor.engine.replies import Reply
from governor.engine.stream import Events, sse

USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def contents(piece: str) -> list[str]:
    """The content deltas of the chunks in one SSE write."""
    out = []
    for line in piece.split("\n\n"):
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                if choice["delta"].get("content"):
                    out.append(choice["delta"]["content"])
    return out


def test_tokens_ready_together_go_out_in_one_chunk_and_the_first_at_once() -> None:
    async def main() -> list[str]:
        events = Events(asyncio.get_running_loop(), eager=True)
        stream = sse(events, [], Reply("m"), include_usage=False)
        pieces = [await anext(stream)]  # the opening
        events(Text("Hello"))
        pieces.append(await anext(stream))  # the first token alone, without waiting for more

        def produce() -> None:
            for token in (" wide", " wide", " world"):
                events(Text(token))

        worker = threading.Thread(target=produce)
        worker.start()
        worker.join()  # three tokens arrive while the loop is busy elsewhere
        pieces.append(await anext(stream))
        events(Ended("length", USAGE))
        pieces.append(await anext(stream))
        return pieces

    _opening, first, three, end = asyncio.run(main())
    assert contents(first) == ["Hello"]
    assert contents(three) == [" wide wide world"]  # one chunk, one write
    assert three.count("data: ") == 1
    assert end.endswith("data: [DONE]\n\n")
