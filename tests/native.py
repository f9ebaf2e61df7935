"""Run native llama.cpp work in a child process, so that a crash (SIGSEGV, SIGABRT) fails one test, not the run.

The pytest process never imports llama_cpp (tests/conftest.py checks it): a test hands a module-level function to
`in_child`, which runs it in a fresh interpreter (multiprocessing "spawn": no state is inherited) and returns its
result. A child killed by a signal fails the test naming the signal; an exception in the child fails it with the
child's traceback.
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, ParamSpec, TypeVar

import pytest

P = ParamSpec("P")
T = TypeVar("T")


def _child(conn: Connection, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # reported to the parent, which fails the test with it
        conn.send(("raised", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    else:
        conn.send(("returned", result, ""))
    finally:
        conn.close()


def in_child(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` in a child process; `fn` must be importable (module level) and its result picklable."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(theirs, fn, args, kwargs), name=f"native:{fn.__name__}")
    proc.start()
    theirs.close()
    try:
        # The pipe, not join(): a large result would fill the pipe and the child would never exit.
        message = ours.recv() if ours.poll(600) else None
    except EOFError:  # the child died before it could answer
        message = None
    finally:
        ours.close()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    code = proc.exitcode
    if message is None:
        if code is not None and code < 0:
            pytest.fail(f"{fn.__name__} crashed the child process: killed by {signal.Signals(-code).name}")
        pytest.fail(f"{fn.__name__}: the child process exited with {code} without an answer")
    kind, value, trace = message
    if kind == "raised":
        pytest.fail(f"{fn.__name__} raised in the child process: {value}\n{trace}", pytrace=False)
    result: T = value
    return result
