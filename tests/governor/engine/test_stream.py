"""The worker -> event loop hand-off: tokens that pile up while the loop is busy, or within the stream interval,
leave as one SSE chunk."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

from governor.engine.events import Ended, Text
from governor.engine.replies import Reply
from governor.engine.stream import AUTO_INTERVAL_S, KEEPALIVE, Events, sse, stream_interval_s

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


def test_with_an_interval_text_waits_for_it_but_the_first_token_and_the_end_do_not() -> None:
    async def main() -> tuple[list[str], bool, list[str]]:
        loop = asyncio.get_running_loop()
        events = Events(loop, eager=True, interval_s=3600.0)
        stream = sse(events, [], Reply("m"), include_usage=False)
        await anext(stream)  # the opening
        events(Text("Hello"))
        first = await anext(stream)  # the first text: at once
        events(Text(" wide"))
        events(Text(" world"))
        pending = asyncio.ensure_future(anext(stream))
        done, _ = await asyncio.wait({pending}, timeout=0.05)
        held = not done  # within the hour, more text does not wake the stream
        events(Ended("length", USAGE))  # the end does, with the text held so far
        return contents(first), held, contents(await pending)

    first, held, last = asyncio.run(main())
    assert first == ["Hello"]
    assert held
    assert last == [" wide world"]


def test_text_after_the_interval_goes_out_no_sooner_than_the_interval() -> None:
    interval = 0.05

    async def main() -> tuple[float, float, list[str]]:
        loop = asyncio.get_running_loop()
        events = Events(loop, eager=True, interval_s=interval)
        stream = sse(events, [], Reply("m"), include_usage=False)
        await anext(stream)
        events(Text("a"))
        await anext(stream)
        t_first = loop.time()
        events(Text("b"))
        events(Text("c"))
        second = await anext(stream)
        return t_first, loop.time(), contents(second)

    t_first, t_second, second = asyncio.run(main())
    assert t_second - t_first >= interval * 0.99
    assert second == ["bc"]


def test_text_within_the_interval_does_not_wake_the_loop() -> None:
    """One wake-up a chunk: the worker's text while the interval runs waits for the interval's own timer (each
    cross-thread wake-up is a loop iteration taken from the decode threads' cores)."""

    async def main() -> tuple[int, list[str]]:
        loop = asyncio.get_running_loop()
        wakes = 0
        threadsafe = loop.call_soon_threadsafe

        def counted(*args: Any) -> asyncio.Handle:
            nonlocal wakes
            wakes += 1
            return threadsafe(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        events = Events(loop, eager=True, interval_s=3600.0)
        stream = sse(events, [], Reply("m"), include_usage=False)
        await anext(stream)
        events(Text("a"))
        await anext(stream)  # the first text: one wake-up, and the interval starts
        await asyncio.sleep(0)  # the wake-up's callback runs

        def produce() -> None:
            for token in "bcd":
                events(Text(token))

        worker = threading.Thread(target=produce)
        worker.start()
        worker.join()
        held = wakes
        events(Ended("length", USAGE))
        return held, contents(await anext(stream))

    held, last = asyncio.run(main())
    assert held == 1  # "b", "c" and "d" woke nothing
    assert last == ["bcd"]


def test_the_auto_interval_coalesces_only_when_the_decode_threads_take_every_cpu() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert stream_interval_s(None, cpus) == AUTO_INTERVAL_S
    assert stream_interval_s(None, cpus + 4) == AUTO_INTERVAL_S
    assert stream_interval_s(None, cpus - 1) == (0.0 if cpus > 1 else AUTO_INTERVAL_S)
    assert stream_interval_s(0.0, cpus) == 0.0  # asked for every token
    assert stream_interval_s(250.0, 1) == 0.25


def test_a_stream_with_nothing_to_say_sends_a_comment_that_keeps_the_client_waiting() -> None:
    async def main() -> tuple[list[str], list[str]]:
        events = Events(asyncio.get_running_loop(), eager=True)
        stream = sse(events, [], Reply("m"), include_usage=False, keepalive_s=0.02)
        await anext(stream)  # the opening
        quiet = [await anext(stream), await anext(stream)]  # paused: nothing comes
        events(Text("Hello"))
        events(Ended("length", USAGE))
        return quiet, contents(await anext(stream))

    quiet, after = asyncio.run(main())
    assert quiet == [KEEPALIVE, KEEPALIVE]
    assert KEEPALIVE.startswith(":")  # an SSE comment: no event for the client, but bytes for its read timeout
    assert after == ["Hello"]  # the answer goes on as if nothing happened
