"""The daemon's signal handlers: they only record, and the loop does the work (uvicorn's rule, STYLE.md 9).

A handler runs on the main thread between two bytecodes of whatever it interrupted, including itself and including
code holding a lock: a `threading.Event.set()` there deadlocks when the signal lands inside another `set()` (a storm of
SIGHUPs froze the loop: ticks stopped, SIGTERM was ignored) or nests until RecursionError (issue 33). So a handler
here adds the signal number to a set (one C call: atomic for Python code) and releases the loop's `Wake` (a lock
release that never waits), and only when the signal is not already pending: a storm of N signals is one pending
signal and at most one wake-up per time the loop took it.

A second SIGTERM / SIGINT once stopping has begun calls `on_again` from the handler itself (the shutdown is not the
loop's): it must only set a plain attribute (`EngineSupervisor.hurry`).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from governor.clock import Wake

STOPS = frozenset({signal.SIGTERM, signal.SIGINT})
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def hold_hangups() -> None:
    """Hold SIGHUP blocked while the daemon starts up (until `SignalInbox.install`): its default action ends the
    process, and a reload asked during a restart (`pkill -HUP governor`, a storm) killed the daemon before it served.
    Blocked, not handled: a storm of them is one pending signal and costs the start-up nothing, where a Python handler
    ran once per signal and a storm held the start-up in its imports for minutes (CI, stop 36). The blocked mask and
    the pending signal both survive `execv`, so the reload it asked for happens once the loop's handler is in."""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})


class SignalInbox:
    def __init__(self, wake: Wake, *, on_again: Callable[[], None] = lambda: None) -> None:
        self._wake = wake
        self._on_again = on_again
        self._pending: set[int] = set()
        self.stopping = False  # set by the loop when it took a stop signal (or was asked to stop)
        self._installed = False

    def install(self) -> bool:
        """Handlers for SIGTERM, SIGINT and SIGHUP; False off the main thread (a test running the daemon in a
        thread stops it itself)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in HANDLED:
            signal.signal(signum, self._record)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # one held during start-up is delivered now
        self._installed = True
        return True

    def ignore(self) -> None:
        """After the shutdown: a signal still arriving has nothing left to stop. Ignored, not restored to the default:
        the interpreter's own exit puts the default back on Python handlers, and a storm outlasting the shutdown
        then killed a daemon that had stopped cleanly (exit -15 instead of 0)."""
        if self._installed:
            sys.unraisablehook = _without_ignored_signal_reports(sys.unraisablehook)
            for signum in HANDLED:
                signal.signal(signum, signal.SIG_IGN)

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        if self.stopping and signum in STOPS:
            self._on_again()
            return
        if signum in self._pending:
            return  # coalesced: the loop has not taken the last one yet
        self._pending.add(signum)
        self._wake.set()

    def pending(self, signum: int) -> bool:
        return signum in self._pending

    def take(self, signum: int) -> bool:
        """Whether `signum` was pending; it no longer is (a signal arriving from now on is a new one)."""
        if signum not in self._pending:
            return False
        self._pending.discard(signum)
        return True

    def take_stop(self) -> bool:
        """A SIGTERM or SIGINT was pending: stopping begins (a further one calls `on_again`)."""
        taken = self.take(signal.SIGTERM) | self.take(signal.SIGINT)
        if taken:
            self.stopping = True
        return taken


def _without_ignored_signal_reports(
    hook: Callable[[sys.UnraisableHookArgs], object],
) -> Callable[[sys.UnraisableHookArgs], object]:
    """`hook`, but silent on CPython's report of a stop or reload signal that came after its handler became SIG_IGN.

    The C-level handler marks a signal as it arrives and Python runs the handler later; one arriving between
    `signal.signal`'s check of pending signals and its switch to SIG_IGN is marked with no handler left to run, and
    CPython reports "OSError: Signal 15 ignored due to race condition" with a traceback on stderr (a storm of SIGTERMs
    ended a clean shutdown with one). Ignoring it is what was asked: anything else still reaches `hook`."""
    ignored = {f"Signal {int(signum)} ignored due to race condition" for signum in HANDLED}

    def filtered(unraisable: sys.UnraisableHookArgs) -> object:
        if isinstance(unraisable.exc_value, OSError) and str(unraisable.exc_value) in ignored:
            return None
        return hook(unraisable)

    return filtered
