"""Log lines reach the stream whole: the daemon copies its engine's stderr into the same fd from another thread."""

from __future__ import annotations

import io
import json

import structlog

from governor import logs


class Writes(io.StringIO):
    """A text stream that records each write() call it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_each_log_line_is_one_write_with_its_newline() -> None:
    out = Writes()
    logs.configure(json=True, stream=out)
    structlog.get_logger("t").info("engine configured", threads=4)
    structlog.get_logger("t").info("second")
    assert len(out.calls) == 2
    assert all(call.endswith("\n") and call.count("\n") == 1 for call in out.calls)
    assert [json.loads(call)["event"] for call in out.calls] == ["engine configured", "second"]
