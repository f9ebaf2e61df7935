"""VirtualClock: time moves only in waits; scheduled callbacks (simulated uevents) cut a wait short."""

from __future__ import annotations

import threading

import pytest

from governor.clock import VirtualClock


def test_wait_advances_by_the_timeout() -> None:
    clock = VirtualClock(start_s=10.0)
    assert clock.wait(threading.Event(), 2.5) is False
    assert clock.now() == 12.5
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1.0)


def test_a_callback_that_sets_the_event_ends_the_wait_at_its_time() -> None:
    clock = VirtualClock()
    wake = threading.Event()
    seen: list[float] = []
    clock.call_at(0.7, lambda: seen.append(clock.now()))  # does not set the event: the wait goes on
    clock.call_at(1.5, wake.set)
    assert clock.wait(wake, 10.0) is True
    assert clock.now() == 1.5
    assert seen == [0.7]
    wake.clear()
    assert clock.wait(wake, 1.0) is False
    assert clock.now() == 2.5


def test_callbacks_beyond_the_timeout_wait_for_a_later_wait() -> None:
    clock = VirtualClock()
    wake = threading.Event()
    clock.call_at(5.0, wake.set)
    assert clock.wait(wake, 1.0) is False
    assert clock.now() == 1.0
    assert clock.wait(wake, 10.0) is True
    assert clock.now() == 5.0
