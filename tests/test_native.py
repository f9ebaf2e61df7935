"""tests/native.py: a native crash in the child fails the one test, naming the signal; the pytest process lives on."""

from __future__ import annotations

import os
import signal

import pytest

from tests.native import in_child


def crash(sig: int) -> None:
    os.kill(os.getpid(), sig)


def fail(message: str) -> None:
    raise ValueError(message)


def add(a: int, b: int) -> int:
    return a + b


def test_a_result_comes_back() -> None:
    assert in_child(add, 2, b=3) == 5


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT])
def test_a_crash_fails_the_test_naming_the_signal(sig: signal.Signals) -> None:
    with pytest.raises(pytest.fail.Exception, match=f"crash crashed the child process: killed by {sig.name}"):
        in_child(crash, int(sig))


def test_an_exception_in_the_child_fails_the_test_with_its_traceback() -> None:
    with pytest.raises(
        pytest.fail.Exception, match=r"fail raised in the child process: ValueError: no such thing"
    ) as e:
        in_child(fail, "no such thing")
    assert "Traceback" in str(e.value)
