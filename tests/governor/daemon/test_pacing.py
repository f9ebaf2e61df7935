"""The rate cap paced on the public socket (governor.daemon.pacing): events leave no faster than the cap, and the
engine process is held while an event it computed early waits, and always let go."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from governor.daemon.pacing import Pace


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def engine() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in engine process (the pace only signals it)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    yield proc
    proc.kill()
    proc.wait()


def body_of(pieces: list[bytes]) -> Callable[[], Awaitable[bytes | None]]:
    it = iter(pieces)

    async def body() -> bytes | None:
        return next(it, None)

    return body


def events(n: int) -> bytes:
    return b"".join(b'data: {"i": %d}\n\n' % i for i in range(n))


def relay(pace: Pace, pieces: list[bytes], watch: Callable[[], None] = lambda: None) -> list[tuple[float, bytes]]:
    sent: list[tuple[float, bytes]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def send(data: bytes) -> None:
            watch()
            sent.append((loop.time(), data))

        await pace.relay(body_of(pieces), send)

    asyncio.run(main())
    return sent


def test_without_a_cap_every_piece_goes_on_at_once_as_events() -> None:
    sent = relay(Pace(), [events(3), b"data: [DO", b"NE]\n\n"])

    assert [d for _, d in sent] == [b'data: {"i": 0}\n\n', b'data: {"i": 1}\n\n', b'data: {"i": 2}\n\n',
                                    b"data: [DO", b"NE]\n\n"]  # fmt: skip


def test_events_leave_no_faster_than_the_cap_the_first_at_once() -> None:
    pace = Pace()
    pace.cap = 40.0  # 25 ms apart

    sent = relay(pace, [events(6), events(2)])

    times = [t for t, _ in sent]
    assert len(times) == 8
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.025 - 0.002  # never sooner (later is the machine's load, not the pace)


def test_a_cap_set_mid_answer_applies_from_the_next_event() -> None:
    pace = Pace()
    sent: list[float] = []

    def watch() -> None:
        if len(sent) == 2:
            pace.cap = 20.0
        sent.append(asyncio.get_running_loop().time())

    relay(pace, [events(5)], watch)

    assert min(b - a for a, b in itertools.pairwise(sent[2:])) >= 0.05 - 0.002


def test_the_engine_is_held_while_an_early_event_waits_and_let_go_after(engine: subprocess.Popen[bytes]) -> None:
    pace = Pace(lambda: engine.pid)
    pace.cap = 5.0  # 200 ms apart: the engine (already done) is ahead
    states: list[str] = []

    relay(pace, [events(3)], lambda: states.append(process_state(engine.pid)))

    assert pace.holds >= 2  # held during each wait
    assert "T" not in states  # let go as each event left
    assert process_state(engine.pid) not in "Tt"  # and never left stopped (R, S or D: a page fault on a busy box)


def test_a_cancelled_answer_lets_the_engine_go(engine: subprocess.Popen[bytes]) -> None:
    pace = Pace(lambda: engine.pid)
    pace.cap = 0.5  # a 2 s wait, cut short

    async def main() -> None:
        async def send(_data: bytes) -> None:
            pass

        task = asyncio.ensure_future(pace.relay(body_of([events(2)]), send))
        await asyncio.sleep(0.3)
        assert process_state(engine.pid) == "T"  # held while the second event waits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())

    assert process_state(engine.pid) not in "Tt"  # running or asleep (D too: a page fault on a busy box), not stopped


def test_a_gone_engine_is_only_paced() -> None:
    pace = Pace(lambda: 2**22 + 12345)  # no such process
    pace.cap = 100.0

    assert len(relay(pace, [events(3)])) == 3
    assert pace.holds == 0
