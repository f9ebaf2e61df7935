"""Supervision with real child processes (small Python programs standing in for the engine's life and death)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from governor.clock import RealClock
from governor.daemon.supervisor import (
    EngineSupervisor,
    RestartPolicy,
    SupervisedDecider,
    memory_kill_evidence,
    step_down,
)
from policies.decision import Decision, EngineConfig, Hold, State
from policies.ladder import ModelLadder, ModelTier
from sensors.snapshot import EngineObservation, Memory, Snapshot
from tests.helpers import eventually

LADDER = ModelLadder(
    tier=(
        ModelTier(name="large", path=Path("large.gguf"), n_ctx=2048),
        ModelTier(name="medium", path=Path("medium.gguf"), n_ctx=2048),
        ModelTier(name="small", path=Path("small.gguf"), n_ctx=1024),
    )
)
LARGE = EngineConfig(threads=4, n_ctx=2048, model="large")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
CRASHER = [sys.executable, "-c", "import sys; sys.exit(3)"]
FAST = RestartPolicy(initial_s=0.01, max_s=0.05, max_failures=3, stable_s=60.0)
PRESSURE = Snapshot(memory=Memory(total_bytes=2**30, available_bytes=2**24, psi_some_avg10=45.0, psi_full_avg10=20.0))


class Policy:
    """A policy core that always asks for the largest model."""

    def decide(
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, holds: Sequence[Hold] = ()
    ) -> Decision:
        return Decision(t=t, state=State.IDLE, engine=LARGE, reason="idle: nothing running", rule="activity.idle")

    def interval_s(self, decision: Decision) -> float:
        return 1.0


class Harness:
    def __init__(self, argv: list[str], *, snapshot: Snapshot | None = None, restart: RestartPolicy = FAST) -> None:
        self.started: list[EngineConfig] = []
        self.configured: list[EngineConfig] = []
        self.snapshot = snapshot
        self.kernel_log: str | None = None  # dmesg unreadable, unless a test says otherwise

        def command(cfg: EngineConfig) -> list[str]:
            self.started.append(cfg)
            return argv

        self.supervisor = EngineSupervisor(
            command=command,
            ready=lambda _timeout_s: True,
            configure=self.configured.append,
            ladder=LADDER,
            restart=restart,
            clock=RealClock(),
            latest_snapshot=lambda: self.snapshot,
            kernel_log=lambda: self.kernel_log,
        )


def ready_pid(supervisor: EngineSupervisor) -> int:
    eventually(lambda: supervisor.ready)
    pid = supervisor.pid
    assert pid is not None
    return pid


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(SLEEPER)
    yield h
    h.supervisor.stop(5.0)


def test_step_down_takes_the_next_tier_then_halves_the_context() -> None:
    assert step_down(LADDER, LARGE) == ("medium", 2048)
    assert step_down(LADDER, LARGE.model_copy(update={"model": "medium"})) == ("small", 1024)
    assert step_down(LADDER, LARGE.model_copy(update={"model": "small", "n_ctx": 1024})) == ("small", 512)
    assert step_down(LADDER, LARGE.model_copy(update={"model": "small", "n_ctx": 256})) is None


def test_back_off_doubles_up_to_its_ceiling() -> None:
    policy = RestartPolicy(initial_s=1, factor=2, max_s=10)
    assert [policy.delay_s(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 8, 10]


def test_the_first_decision_starts_the_engine_with_its_settings(harness: Harness) -> None:
    harness.supervisor.want(LARGE)
    eventually(lambda: harness.supervisor.ready)
    assert harness.started == [LARGE]
    assert harness.configured == [LARGE]  # what the command line cannot say (the rate cap) is posted once ready


def test_a_killed_engine_is_restarted(harness: Harness) -> None:
    harness.supervisor.want(LARGE)
    pid = ready_pid(harness.supervisor)
    os.kill(pid, signal.SIGKILL)
    eventually(lambda: harness.supervisor.status.starts == 2 and harness.supervisor.ready)
    status = harness.supervisor.status
    assert status.pid != pid
    assert status.last_exit is not None
    assert status.last_exit.startswith("engine killed by SIGKILL after")
    assert status.cap is None  # no memory pressure: the same engine again
    assert harness.started == [LARGE, LARGE]


def test_killed_under_memory_pressure_restarts_one_step_smaller() -> None:
    h = Harness(SLEEPER, snapshot=PRESSURE)
    try:
        h.supervisor.want(LARGE)
        pid = ready_pid(h.supervisor)
        os.kill(pid, signal.SIGKILL)
        eventually(lambda: len(h.started) == 2)
        assert h.started[1].model == "medium"
        status = h.supervisor.status
        assert status.cap is not None
        assert status.cap.model == "medium"
        assert "memory pressure was high (PSI some 45%" in (status.last_exit or "")
        assert "restarting one step smaller (medium, n_ctx 2048)" in (status.last_exit or "")
        # The policy keeps asking for the large model: the supervisor's cap holds, and the reason says why.
        decision = SupervisedDecider(Policy(), h.supervisor).decide(Snapshot(), None, 5.0)
        assert decision.engine.model == "medium"
        assert "capped at medium/n_ctx 2048 (SIGKILL while memory pressure was high" in decision.reason
    finally:
        h.supervisor.stop(5.0)


OOM_RECORD = """\
[ 8123.402311] python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0
[ 8123.402990] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,task_memcg=/,\
task=python3,pid={pid},uid=0
[ 8123.403012] Out of memory: Killed process {pid} (python3) total-vm:2345678kB, anon-rss:1234567kB, file-rss:0kB
"""


def test_memory_kill_evidence() -> None:
    calm = Snapshot(memory=Memory(total_bytes=2**30, available_bytes=2**29, psi_some_avg10=0.5))
    kill, term = -signal.SIGKILL, -signal.SIGTERM
    assert memory_kill_evidence(kill, 99, PRESSURE, 10.0, lambda: None) is not None
    assert memory_kill_evidence(term, 99, PRESSURE, 10.0, lambda: None) is None  # only SIGKILL
    assert memory_kill_evidence(kill, 99, calm, 10.0, lambda: None) is None
    record = OOM_RECORD.format(pid=4321)
    found = memory_kill_evidence(kill, 4321, calm, 10.0, lambda: record)
    assert found == "killed by the kernel's OOM killer (kernel log)"
    assert memory_kill_evidence(kill, 432, calm, 10.0, lambda: record) is None  # another process's record


def test_an_oom_record_in_the_kernel_log_also_steps_down() -> None:
    h = Harness(SLEEPER)
    try:
        h.supervisor.want(LARGE)
        pid = ready_pid(h.supervisor)
        h.kernel_log = OOM_RECORD.format(pid=pid)
        os.kill(pid, signal.SIGKILL)
        eventually(lambda: len(h.started) == 2)
        assert h.started[1].model == "medium"
        assert "OOM killer" in (h.supervisor.status.last_exit or "")
    finally:
        h.supervisor.stop(5.0)


def test_repeated_failures_mean_critical_not_a_crash_loop() -> None:
    h = Harness(CRASHER)
    try:
        h.supervisor.want(LARGE)
        eventually(lambda: h.supervisor.status.critical)
        starts = h.supervisor.status.starts
        assert starts == FAST.max_failures
        decision = SupervisedDecider(Policy(), h.supervisor).decide(Snapshot(), None, 9.0)
        assert decision.state == State.CRITICAL
        assert decision.rule == "supervisor.given_up"
        assert decision.reason.startswith("critical: engine failed 3 times in a row, last: engine exited with status 3")
        # a reload (or the operator) asks for another try
        h.supervisor.reset()
        eventually(lambda: h.supervisor.status.starts > starts)
    finally:
        h.supervisor.stop(5.0)


def test_stop_terminates_the_engine(harness: Harness) -> None:
    harness.supervisor.want(LARGE)
    pid = ready_pid(harness.supervisor)
    harness.supervisor.stop(5.0)
    assert not harness.supervisor.status.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert harness.supervisor.status.starts == 1  # stopping is not a death to restart from


def test_a_silent_engine_is_killed_and_restarted() -> None:
    """The probe gets no answer (a SIGSTOPped or deadlocked engine): not ready meanwhile, killed after hang_s."""
    answers = [True]
    policy = RestartPolicy(initial_s=0.01, max_s=0.05, probe_interval_s=0.05, probe_timeout_s=0.01, hang_s=0.3)
    h = Harness(SLEEPER, restart=policy)
    h.supervisor._probe = lambda _timeout_s: answers[0]
    h.supervisor.want(LARGE)
    first = ready_pid(h.supervisor)
    try:
        answers[0] = False
        eventually(lambda: not h.supervisor.ready)
        eventually(lambda: h.supervisor.status.starts == 2, timeout_s=10)
        assert "hung (no answer for" in str(h.supervisor.status.last_exit)
        answers[0] = True
        assert ready_pid(h.supervisor) != first
    finally:
        h.supervisor.stop(5.0)


def test_an_engine_that_cannot_be_started_is_retried_and_reported() -> None:
    h = Harness(["/nonexistent/engine"])
    h.supervisor.want(LARGE)
    try:
        eventually(lambda: h.supervisor.status.critical is not None, timeout_s=10)
        assert "could not start (No such file or directory)" in str(h.supervisor.status.last_exit)
        assert len(h.started) == FAST.max_failures  # tried each time, not one dead thread
    finally:
        h.supervisor.stop(5.0)
