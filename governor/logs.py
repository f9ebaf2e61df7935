"""structlog, configured once: JSON lines when stderr is not a TTY (journald, Termux logs), console on a TTY."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO, cast

import structlog


class Tolerant:
    """A log stream whose writes never raise: a full or failing filesystem under the log (ENOSPC, EIO) or a closed
    pipe loses lines, never the tick or the request that logged them (issue 33). Counts what it lost."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lost = 0

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):  # ValueError: the stream was closed
            self.lost += 1
            return 0

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            self.lost += 1

    def isatty(self) -> bool:
        return self.stream.isatty()


def _tolerant(stream: TextIO) -> TextIO:
    return cast(TextIO, stream if isinstance(stream, Tolerant) else Tolerant(stream))


def configure(*, json: bool | None = None, level: int = logging.INFO, stream: TextIO | None = None) -> None:
    out = stream if stream is not None else sys.stderr
    as_json = not out.isatty() if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write per line (print() writes the text and its newline separately: the daemon copies its engine's
        # stderr into the same fd from another thread, and a line could land between them).
        logger_factory=structlog.WriteLoggerFactory(_tolerant(out)),
        cache_logger_on_first_use=False,
    )


def reset() -> None:
    """Back to structlog's defaults; the tests' autouse fixture calls this."""
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def keep_own_stderr() -> None:
    """Log to a private copy of stderr from now on.

    llama-cpp-python silences a model load (`verbose=False`) by pointing fds 1 and 2 at /dev/null for the whole
    process while it runs; the engine loads models on its worker thread while the event loop keeps logging, and
    those lines would be lost.
    """
    stream = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
    structlog.configure(logger_factory=structlog.WriteLoggerFactory(_tolerant(stream)))
