"""The daemon's signal handlers after the shutdown, in a child interpreter (handlers are per process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A SIGTERM that arrives while `SignalInbox.ignore` switches the handlers to SIG_IGN: CPython's C-level handler
# (the one `signal.signal` installed, found with sigaction) marks it, and Python finds no handler left to run it.
LATE_SIGNAL = textwrap.dedent(
    """
    import ctypes, signal
    from governor.clock import Wake
    from governor.daemon.signals import SignalInbox

    inbox = SignalInbox(Wake())
    assert inbox.install()
    action = ctypes.create_string_buffer(512)  # struct sigaction: sa_handler first
    assert ctypes.CDLL(None).sigaction(signal.SIGTERM, None, action) == 0
    c_handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(ctypes.c_void_p.from_buffer(action).value)
    inbox.ignore()
    c_handler(signal.SIGTERM)
    sum(range(1000))  # the interpreter looks at marked signals between bytecodes
    class Broken:
        def __del__(self):
            raise OSError("another")
    Broken()
    print("stopped cleanly")
    """
)


def test_a_stop_signal_caught_by_the_switch_to_ignored_prints_no_traceback() -> None:
    done = subprocess.run([sys.executable, "-c", LATE_SIGNAL], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, "stopped cleanly\n"), done.stderr
    assert "race condition" not in done.stderr
    assert "OSError: another" in done.stderr  # other unraisable errors are still reported


# `governor run` before its re-exec: SIGHUPs are held (not fatal, and not a handler run per signal), and they survive
# the exec into the lean daemon.
HELD_ACROSS_EXEC = textwrap.dedent(
    """
    import os, signal, sys
    from governor.daemon.signals import hold_hangups

    hold_hangups()
    for _ in range(10_000):
        os.kill(os.getpid(), signal.SIGHUP)
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
    """
)
# The lean daemon: more of them while it starts up, then the loop's handlers; a child started after that (the engine)
# has SIGHUP's default back.
INSTALLED = textwrap.dedent(
    """
    import os, signal, subprocess
    from governor.clock import Wake
    from governor.daemon.signals import SignalInbox, hold_hangups

    hold_hangups()
    os.kill(os.getpid(), signal.SIGHUP)
    inbox = SignalInbox(Wake())
    assert inbox.install()
    sum(range(1000))  # the interpreter looks at marked signals between bytecodes
    print("reload pending:", inbox.take(signal.SIGHUP), "then:", inbox.take(signal.SIGHUP))
    child = subprocess.run(["grep", "SigBlk", "/proc/self/status"], capture_output=True, text=True, check=True)
    print("child blocks:", child.stdout.split()[1])
    """
)


def test_sighups_during_start_up_are_one_reload_once_the_loop_listens() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HELD_ACROSS_EXEC, INSTALLED], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout) == (
        0,
        "reload pending: True then: False\nchild blocks: 0000000000000000\n",
    ), done.stderr
