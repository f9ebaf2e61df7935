"""Run native llama.cpp work in a child process, so that a crash (SIGSEGV, SIGABRT) fails one test, not the run.

The pytest process never imports llama_cpp (tests/conftest.py checks it): a test hands a module-level function to
`in_child`, which runs it in a fresh interpreter (multiprocessing "spawn": no state is inherited) and returns its
result. A child killed by a signal fails the test naming the signal; an exception in the child fails it with the
child's traceback. `run_child` returns how the child ended instead, for a test whose point is that a crash stays there.

In the child, every llama.cpp model is loaded through the engine's own `governor.engine.model.open_llama` (or
`LoadedModel`), which takes the engine's extra-buffers decision for this CPU and library: a test's load takes the same
native path as the product's (tests/test_native.py checks that no test builds a `Llama` any other way).
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Outcome:
    """How a child run ended: `killed` by a signal (None if it answered), else `returned` or `raised` with a value."""

    name: str
    killed: signal.Signals | None
    exitcode: int | None
    kind: str = ""
    value: Any = None
    trace: str = ""


def run_child(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Outcome:
    """`fn(*args, **kwargs)` in a child process (`spawn`: nothing inherited); how it ended, a crash included."""
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
    killed = signal.Signals(-code) if message is None and code is not None and code < 0 else None
    if message is None:
        return Outcome(fn.__name__, killed, code)
    kind, value, trace = message
    return Outcome(fn.__name__, None, code, kind, value, trace)


def in_child(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` in a child process; `fn` must be importable (module level) and its result picklable.
    A crash or an exception in the child fails the test, naming the signal or showing the child's traceback."""
    out = run_child(fn, *args, **kwargs)
    if out.killed is not None:
        pytest.fail(f"{out.name} crashed the child process: killed by {out.killed.name}")
    if not out.kind:
        pytest.fail(f"{out.name}: the child process exited with {out.exitcode} without an answer")
    if out.kind == "raised":
        pytest.fail(f"{out.name} raised in the child process: {out.value}\n{out.trace}", pytrace=False)
    result: T = out.value
    return result
