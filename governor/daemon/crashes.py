"""Why the engine died (a memory kill? a crash?) and why it keeps dying, in words: what killed it, at which phase,
on which tier, what was tried, its last words.

The supervisor records one `Crash` per native-looking death (a crash signal or a non-zero exit) and keeps the tail of
the child's stderr (`StderrTail`, which also copies every line to the daemon's own stderr, so the journal keeps it).
`explain()` turns them into the line `governor status` and `governor why` show. `wait_exit` and `terminate` are the
supervisor's waits on the child.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import IO

from sensors.snapshot import Snapshot

# Signals a process sends itself when native code goes wrong. SIGKILL/SIGTERM/SIGINT come from outside (the user,
# the OOM killer, systemd): a restart with the same settings is right for those.
CRASH_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGTRAP, signal.SIGSYS}
)
TAIL_LINES = 20
TAIL_CHARS = 300


class Phase(StrEnum):
    LOAD = "during load"
    FIRST_DECODE = "in the first decode"
    ANSWERING = "while answering"
    IDLE = "while idle"


def phase_of(*, was_ready: bool, requests: int, answered: int) -> Phase:
    """Where the engine was when it died: before it answered its socket, under its first request, later."""
    if not was_ready:
        return Phase.LOAD
    if requests > answered:
        return Phase.FIRST_DECODE if answered == 0 else Phase.ANSWERING
    return Phase.IDLE


def exit_name(returncode: int) -> str:
    """'SIGSEGV' or 'exit status 3'."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def is_crash(returncode: int) -> bool:
    """A death that a safer setting may avoid: a crash signal, or a non-zero exit (a Python error at load)."""
    return returncode > 0 or (returncode < 0 and -returncode in CRASH_SIGNALS)


@dataclass(frozen=True)
class Crash:
    t: float  # clock time of the death
    how: str  # exit_name()
    phase: Phase
    tier: str


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def explain(crashes: Sequence[Crash], tried: Sequence[str], stderr: str | None) -> str:
    """'engine crashes: SIGSEGV in the first decode of tier large, 3 times in 40 s; tried extra buffers off and
    tier medium; last engine stderr: ...' (the first crash names the problem; later ones ran on safer settings)."""
    first = crashes[0]
    on = "of" if first.phase in (Phase.LOAD, Phase.FIRST_DECODE) else "on"
    text = f"engine crashes: {first.how} {first.phase} {on} tier {first.tier}"
    if len(crashes) > 1:
        text += f", {len(crashes)} times in {crashes[-1].t - first.t:.0f} s"
    if tried:
        text += f"; tried {_and(tried)}"
    if stderr:
        text += f"; last engine stderr: {stderr}"
    return text


class StderrTail:
    """Copies a child's stderr to `sink_fd` line by line (one write per line) and keeps its last lines."""

    def __init__(self, pipe: IO[bytes], sink_fd: int = 2, lines: int = TAIL_LINES) -> None:
        self._pipe, self._sink = pipe, sink_fd
        self._lines: deque[str] = deque(maxlen=lines)
        self._thread = threading.Thread(target=self._copy, name="engine-stderr", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        try:
            for line in self._pipe:
                with contextlib.suppress(OSError):  # a closed or full sink must not stop the tail
                    os.write(self._sink, line)
                text = line.decode(errors="replace").strip()
                if text:
                    self._lines.append(text)
        finally:
            self._pipe.close()

    def last(self, timeout_s: float = 2.0) -> str | None:
        """The last non-empty line, once the child's stderr has closed (or after `timeout_s`); cut to its end."""
        self._thread.join(timeout_s)
        if not self._lines:
            return None
        line = self._lines[-1]
        return line if len(line) <= TAIL_CHARS else "…" + line[-TAIL_CHARS:]


def read_kernel_log() -> str | None:
    """`dmesg`, when this user may read it (root outside the hardened unit; ProtectKernelLogs= forbids it there)."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=2.0, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def memory_kill_evidence(
    returncode: int,
    pid: int,
    snapshot: Snapshot | None,
    psi_threshold: float,
    kernel_log: Callable[[], str | None] = read_kernel_log,
) -> str | None:
    """Why we believe a SIGKILL came from memory: PSI memory pressure at the time (readable everywhere), else the
    kernel OOM killer's own record of this pid, when the kernel log is readable."""
    if returncode != -signal.SIGKILL:
        return None
    some = snapshot.memory.psi_some_avg10 if snapshot is not None else None
    if some is not None and some >= psi_threshold:
        full = snapshot.memory.psi_full_avg10 if snapshot is not None else None
        return f"SIGKILL while memory pressure was high (PSI some {some:.0f}%, full {full or 0:.0f}%)"
    log = kernel_log()
    if log and re.search(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)", log):
        return "killed by the kernel's OOM killer (kernel log)"
    return None


def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """`proc.wait(timeout_s)`, asleep: Popen.wait with a timeout polls every 50 ms (20 wake-ups a second for as long
    as the engine runs, issue 16); a pidfd lets the kernel wake us when the child exits."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3, or already reaped
        return proc.wait(timeout_s)
    try:
        if not select.select([fd], [], [], timeout_s)[0]:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
    finally:
        os.close(fd)
    return proc.wait()


def terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; its return code."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
