"""Replay: run a policy over a recorded trace (JSON lines of `TraceRecord`), one decision per line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from govbase.errors import GovernorError
from policies.decision import Decision, readable
from policies.machine import StateMachine
from sensors.snapshot import TraceRecord


class TraceError(GovernorError):
    def __init__(self, path: Path | str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = Path(path)
        self.line = line
        self.reason = reason


def read_trace(stream: TextIO, name: Path | str = "<trace>") -> Iterator[TraceRecord]:
    """Parse lines lazily; blank lines are skipped; a bad line raises TraceError naming its number."""
    last_t: float | None = None
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            record = TraceRecord.model_validate_json(line)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise TraceError(name, number, f"{where}: {err['msg']}" if where else err["msg"]) from exc
        if last_t is not None and record.t < last_t:
            raise TraceError(name, number, f"t goes backwards ({record.t} after {last_t})")
        last_t = record.t
        yield record


def replay(trace_lines: Iterable[TraceRecord], governor: StateMachine) -> Iterator[Decision]:
    """The same `decide()` the daemon calls, once per record, in order (a trace carries no holds)."""
    for record in trace_lines:
        yield governor.decide(record, record.engine, record.t)


def decision_json(decision: Decision) -> dict[str, Any]:
    """The `governor replay --json` line: t, state, engine, reason, plus rule and changed."""
    return {
        "t": decision.t,
        "state": decision.state.value,
        "engine": decision.engine.model_dump(),
        "reason": decision.reason,
        "rule": decision.rule,
        "changed": decision.changed,
    }


def decision_text(decision: Decision) -> str:
    engine = " ".join(f"{k}={'-' if v is None else readable(v)}" for k, v in decision.engine.model_dump().items())
    return f"{decision.t:9.2f}  {decision.state.value:<11} {engine}  {decision.rule}: {decision.reason}"


def dumps(decision: Decision) -> str:
    return json.dumps(decision_json(decision), ensure_ascii=False)
