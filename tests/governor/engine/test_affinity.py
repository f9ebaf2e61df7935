"""The thread placement actuator on a real engine process (issue 27, point 4): every thread of the engine, those it
starts later included, runs on the CPUs a decision names; restore() gives them all back; a gone engine is a status,
not an exception."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from governor.daemon.affinity import Affinity
from policies.decision import Decision, EngineConfig, State
from tests.governor.engine.engine_proc import Engine, user

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place threads on one"),
]


def decision(cpus: tuple[int, ...] | None) -> Decision:
    config = EngineConfig(threads=2, n_ctx=1024, model="small")
    return Decision(t=0.0, state=State.SUSTAINED, engine=config, rule="test", affinity=cpus)


def allowed(pid: int) -> dict[int, str]:
    """Each thread's Cpus_allowed_list, as the kernel reports it."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(tid)] = line.split(":", 1)[1].strip()
    return out


def test_the_engines_threads_follow_the_decision_and_come_back(demo_ladder: Path, tmp_path: Path) -> None:
    every = sorted(os.sched_getaffinity(0))
    first = every[0]
    engine = Engine(tmp_path, "--models", str(demo_ladder), "--tier", "small", "--threads", "2")
    try:
        pid = engine.proc.pid
        actuator = Affinity(lambda: pid)
        actuator.apply(decision((first,)))
        assert set(allowed(pid).values()) == {str(first)}
        # llama.cpp starts its compute threads for the answer: they inherit the mask
        reply = engine.chat(model="small", messages=user("hello"), max_tokens=16)
        assert reply.status_code == 200, reply.text
        assert set(allowed(pid).values()) == {str(first)}
        assert actuator.status() == {"cpus": [first], "pid": pid, "error": None}
        actuator.restore()
        assert all(os.sched_getaffinity(tid) == set(every) for tid in allowed(pid))
    finally:
        assert engine.stop() == 0, engine.log()


def test_a_gone_engine_is_reported_not_raised() -> None:
    actuator = Affinity(lambda: 2**22 + 7)  # no such process
    actuator.apply(decision((0,)))
    assert actuator.status()["error"] is not None
    assert "cannot list its threads" in actuator.status()["error"]
