"""Supervision with real child processes (small Python programs standing in for the engine's life and death)."""

from __future__ import annotations

import math
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from governor.clock import RealClock
from governor.daemon.crashes import memory_kill_evidence
from governor.daemon.desired import DesiredEngine
from governor.daemon.driver import Capabilities
from governor.daemon.engine import SupervisedDecider, SupervisedEngine
from governor.daemon.llamacpp import CAPABILITIES
from governor.daemon.restarts import RestartPolicy, step_down
from governor.daemon.supervisor import EngineSupervisor
from policies import StateMachine, load_policy
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
# Says its last words on stderr, then dies by SIGSEGV as a native llama.cpp crash does (no core file).
SEGFAULTER = [
    sys.executable,
    "-c",
    "import os, resource, signal, sys; resource.setrlimit(resource.RLIMIT_CORE, (0, 0));"
    " sys.stderr.write('ggml: something broke\\n'); sys.stderr.flush(); os.kill(os.getpid(), signal.SIGSEGV)",
]
SELF_KILLER = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
FAST = RestartPolicy(initial_s=0.01, max_s=0.05, max_failures=3, stable_s=60.0)
PRESSURE = Snapshot(memory=Memory(total_bytes=2**30, available_bytes=2**24, psi_some_avg10=45.0, psi_full_avg10=20.0))


class Status(BaseModel):
    """An engine's pushed status: its settings and its pid."""

    model_config = ConfigDict(extra="allow")


class Policy:
    """A policy core that asks for the largest model the holds allow (the supervisor's cap comes as a hold)."""

    def __init__(self, config: EngineConfig = LARGE) -> None:
        self.config = config

    def decide(
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, holds: Sequence[Hold] = ()
    ) -> Decision:
        config = self.config
        for hold in holds:
            if hold.max_tier is not None:
                config = config.model_copy(update={"model": hold.max_tier})
            if hold.max_ctx is not None:
                config = config.model_copy(update={"n_ctx": min(config.n_ctx, hold.max_ctx)})
        return Decision(t=t, state=State.IDLE, engine=config, reason="idle: nothing running", rule="activity.idle")

    def interval_s(self, decision: Decision) -> float:
        return 1.0


class Harness:
    def __init__(
        self,
        argv: list[str],
        *,
        snapshot: Snapshot | None = None,
        restart: RestartPolicy = FAST,
        ready: bool = True,
        capabilities: Capabilities = CAPABILITIES,
    ) -> None:
        self.started: list[EngineConfig] = []
        self.configured: list[EngineConfig] = []
        self.prepared: list[EngineConfig] = []  # what the driver was told it is restarted to run
        self.snapshot = snapshot
        self.kernel_log: str | None = None  # dmesg unreadable, unless a test says otherwise

        self.extra_buffers: list[str | None] = []

        def command(cfg: EngineConfig, extra_buffers: str | None) -> list[str]:
            self.started.append(cfg)
            self.extra_buffers.append(extra_buffers)
            return argv

        harness, caps = self, capabilities
        self.policy = Policy()

        class Link:
            capabilities = caps

            def apply(self, config: EngineConfig) -> None:
                harness.configured.append(config)

            def pause(self, reason: str | None) -> None:
                del reason

            def prepare_restart(self, config: EngineConfig) -> None:
                harness.prepared.append(config)

        self.desired = DesiredEngine(Link())
        self.supervisor = EngineSupervisor(
            command=command,
            ready=lambda _timeout_s: Status(pid=self.supervisor.pid) if ready else None,  # ours answers
            desired=self.desired,
            ladder=LADDER,
            restart=restart,
            clock=RealClock(),
            latest_snapshot=lambda: self.snapshot,
            kernel_log=lambda: self.kernel_log,
            on_change=self.tick,
        )

    def tick(self) -> None:
        """What the daemon's loop does when the supervisor wakes it: decide with the supervisor's caps, apply. (Not
        through SupervisedDecider: a test's own `hold()` of the engine would be undone by the fake policy.)"""
        self.want(self.policy.decide(Snapshot(), None, 0.0, self.supervisor.caps()).engine)

    def want(self, config: EngineConfig) -> None:
        """What the engine actuator does with a decision's settings (governor.daemon.engine.SupervisedEngine)."""
        self.desired.want(config, None)
        self.supervisor.start()


def machine() -> StateMachine:
    return StateMachine(load_policy("default"), ladder=LADDER)


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
    harness.want(LARGE)
    eventually(lambda: harness.supervisor.ready)
    assert harness.started == [LARGE]
    eventually(lambda: harness.configured == [LARGE])  # the latest decision is posted once ready (it may have changed)


def test_a_killed_engine_is_restarted(harness: Harness) -> None:
    harness.want(LARGE)
    pid = ready_pid(harness.supervisor)
    os.kill(pid, signal.SIGKILL)
    eventually(lambda: harness.supervisor.status.starts == 2 and harness.supervisor.ready)
    status = harness.supervisor.status
    assert status.pid != pid
    assert status.last_exit is not None
    assert status.last_exit.startswith("engine killed by SIGKILL after")
    assert status.cap is None  # no memory pressure: the same engine again
    assert harness.started == [LARGE, LARGE]


def test_a_setting_the_driver_changes_only_by_a_restart_restarts_the_engine_with_it() -> None:
    """An engine like llama-server: threads are fixed at its start (no live and no in-place change)."""
    fixed = Capabilities.of("llama-server", live=["max_tokens_per_s"], reload=[])
    h = Harness(SLEEPER, capabilities=fixed)
    try:
        h.want(LARGE)
        pid = ready_pid(h.supervisor)
        eventually(lambda: h.configured == [LARGE])  # ready: the same message once more (idempotent)
        capped = LARGE.model_copy(update={"max_tokens_per_s": 5.0})
        h.policy.config = capped
        h.want(capped)  # the rate cap: sent to the running engine
        eventually(lambda: h.configured == [LARGE, capped])
        two = capped.model_copy(update={"threads": 2})
        h.policy.config = two  # what the loop decides from now on
        h.want(two)  # threads: stopped and started again with them
        eventually(lambda: h.supervisor.status.starts == 2 and h.supervisor.ready)
        assert h.supervisor.pid != pid
        assert h.started == [LARGE, two]
        assert h.prepared == [two]  # the driver kept what it could first (llama-server: its slot)
        assert (h.supervisor.status.failures, h.supervisor.status.last_exit) == (0, None)  # not a death
        eventually(lambda: h.configured == [LARGE, capped, two])
        assert h.desired.status()["driver"]["restart"] == [
            "threads",
            "n_ctx",
            "kv_type",
            "model",
            "n_batch",
            "lora_pool_mib",
        ]
    finally:
        h.supervisor.stop(5.0)


def test_killed_under_memory_pressure_restarts_one_step_smaller() -> None:
    h = Harness(SLEEPER, snapshot=PRESSURE)
    try:
        h.want(LARGE)
        pid = ready_pid(h.supervisor)
        os.kill(pid, signal.SIGKILL)
        eventually(lambda: len(h.started) == 2)
        assert h.started[1].model == "medium"
        status = h.supervisor.status
        assert status.cap is not None
        assert status.cap.model == "medium"
        assert "memory pressure was high (PSI some 45%" in (status.last_exit or "")
        assert "restarting one step smaller (medium, n_ctx 2048)" in (status.last_exit or "")
        # The policy would ask for the large model: the supervisor's cap is its input, and the reason says why.
        decision = SupervisedDecider(machine(), h.supervisor).decide(Snapshot(), None, 5.0)
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
        h.want(LARGE)
        pid = ready_pid(h.supervisor)
        h.kernel_log = OOM_RECORD.format(pid=pid)
        os.kill(pid, signal.SIGKILL)
        eventually(lambda: len(h.started) == 2)
        assert h.started[1].model == "medium"
        assert "OOM killer" in (h.supervisor.status.last_exit or "")
    finally:
        h.supervisor.stop(5.0)


def test_repeated_failures_mean_critical_not_a_crash_loop() -> None:
    h = Harness(SELF_KILLER, ready=False)  # a SIGKILL is no crash: no safer settings, the same engine again
    try:
        h.want(LARGE)
        eventually(lambda: h.supervisor.status.critical)
        starts = h.supervisor.status.starts
        assert starts == FAST.max_failures
        assert h.started == [LARGE] * 3
        decision = SupervisedDecider(machine(), h.supervisor).decide(Snapshot(), None, 9.0)
        assert decision.state == State.CRITICAL
        assert decision.rule == "supervisor.given_up"
        assert decision.reason.startswith(
            "critical: engine failed 3 times in a row, last: engine killed by SIGKILL after "
        )
        # a reload (or the operator) asks for another try
        h.supervisor.reset()
        eventually(lambda: h.supervisor.status.starts > starts)
    finally:
        h.supervisor.stop(5.0)


def test_stop_terminates_the_engine(harness: Harness) -> None:
    harness.want(LARGE)
    pid = ready_pid(harness.supervisor)
    harness.supervisor.stop(5.0)
    assert not harness.supervisor.status.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert harness.supervisor.status.starts == 1  # stopping is not a death to restart from


def test_crashes_at_load_try_safer_settings_then_give_up_and_say_why() -> None:
    h = Harness(SEGFAULTER, ready=False)  # dies before its socket answers: during load
    try:
        h.want(LARGE)
        eventually(lambda: h.supervisor.status.critical)
        # each crash took the next safer setting: extra buffers off, then one tier down
        assert [c.model for c in h.started] == ["large", "large", "medium"]
        assert h.extra_buffers == [None, "off", "off"]
        critical = h.supervisor.status.critical
        assert critical is not None
        assert critical.startswith("engine crashes: SIGSEGV during load of tier large, 3 times in ")
        assert "; tried extra buffers off and tier medium; last engine stderr: ggml: something broke" in critical
        decision = SupervisedDecider(machine(), h.supervisor).decide(Snapshot(), None, 9.0)
        assert decision.state == State.CRITICAL
        assert decision.rule == "supervisor.given_up"
        assert decision.reason.startswith(f"critical: {critical}; ")  # what `governor why` shows
        avail = h.supervisor.availability()
        assert avail.given_up
        assert not avail.ready
        assert critical in avail.reason
        assert avail.retry_after_s == math.ceil(FAST.max_s)
        # a reload forgets it all and starts again from the engine's own settings
        h.supervisor.reset()
        eventually(lambda: len(h.started) > 3)
        assert h.started[3] == LARGE
        assert h.extra_buffers[3] is None
    finally:
        h.supervisor.stop(5.0)


def test_backing_off_is_a_wait_with_a_reason_and_a_retry_time() -> None:
    slow = RestartPolicy(initial_s=30.0, max_s=60.0, max_failures=3)
    h = Harness(SEGFAULTER, ready=False, restart=slow)
    try:
        h.want(LARGE)
        eventually(lambda: h.supervisor.status.retry_at is not None)
        status = h.supervisor.status
        assert status.last_exit is not None
        assert status.last_exit.startswith("engine killed by SIGSEGV after ")
        assert status.last_exit.endswith(", during load; restarting with extra buffers off")
        assert status.crashes == (
            "engine crashes: SIGSEGV during load of tier large; tried extra buffers off; "
            "last engine stderr: ggml: something broke"
        )
        avail = h.supervisor.availability()
        assert not avail.ready
        assert not avail.given_up
        assert avail.reason.startswith("the engine is restarting in ")
        assert 30 <= avail.retry_after_s <= 36  # the back-off left plus a load
    finally:
        h.supervisor.stop(5.0)


def test_a_crash_under_the_first_request_is_a_first_decode_crash(harness: Harness) -> None:
    harness.want(LARGE)
    pid = ready_pid(harness.supervisor)
    start = harness.supervisor.request_started(chat=True)
    os.kill(pid, signal.SIGSEGV)
    why = eventually(lambda: harness.supervisor.exit_of(start)) or ""
    assert why.startswith("engine killed by SIGSEGV after ")
    assert why.endswith(", in the first decode; restarting with extra buffers off")
    eventually(lambda: harness.supervisor.status.starts == 2)
    assert harness.extra_buffers == [None, "off"]


def test_a_kill_from_outside_is_not_a_crash_to_take_safer_settings_for(harness: Harness) -> None:
    harness.want(LARGE)
    pid = ready_pid(harness.supervisor)
    harness.supervisor.request_ended(harness.supervisor.request_started(chat=True))  # one answer went through
    harness.supervisor.request_started(chat=True)
    os.kill(pid, signal.SIGKILL)
    eventually(lambda: harness.supervisor.status.starts == 2)
    status = harness.supervisor.status
    assert status.last_exit is not None
    assert status.last_exit.endswith(", while answering")
    assert status.crashes is None
    assert harness.extra_buffers == [None, None]


def test_a_silent_engine_is_killed_and_restarted() -> None:
    """The probe gets no answer (a SIGSTOPped or deadlocked engine): not ready meanwhile, killed after hang_s."""
    answers = [True]
    policy = RestartPolicy(initial_s=0.01, max_s=0.05, probe_interval_s=0.05, probe_timeout_s=0.01, hang_s=0.3)
    h = Harness(SLEEPER, restart=policy)
    h.supervisor._probe = lambda _timeout_s: Status(pid=h.supervisor.pid, **LARGE.model_dump()) if answers[0] else None
    h.want(LARGE)
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
    h.want(LARGE)
    try:
        eventually(lambda: h.supervisor.status.critical is not None, timeout_s=10)
        assert "could not start (No such file or directory)" in str(h.supervisor.status.last_exit)
        assert len(h.started) == FAST.max_failures  # tried each time, not one dead thread
    finally:
        h.supervisor.stop(5.0)


WALL = "no tier fits in 40 MiB; waiting for memory"


def test_while_nothing_fits_no_engine_is_started_and_memory_coming_back_starts_one() -> None:
    h = Harness(SLEEPER, restart=RestartPolicy(initial_s=0.01, max_s=0.05, probe_interval_s=0.1))
    try:
        h.supervisor.hold(WALL)
        h.want(LARGE)
        avail = h.supervisor.availability()
        assert (avail.ready, avail.given_up) == (False, False)  # requests wait: this is not a failure
        assert avail.reason == f"the engine is stopped: {WALL}"  # none running
        eventually(lambda: h.supervisor._thread is not None and h.supervisor._thread.is_alive())
        assert h.supervisor.status.starts == 0
        assert h.started == []
        h.supervisor.hold(None)
        ready_pid(h.supervisor)
        assert h.supervisor.status.starts == 1
    finally:
        h.supervisor.stop(5.0)


def test_a_running_engine_is_stopped_once_its_answers_are_done_and_not_restarted_until_memory_is_back() -> None:
    h = Harness(SLEEPER, restart=RestartPolicy(initial_s=0.01, max_s=0.05, probe_interval_s=0.1))
    try:
        h.want(LARGE)
        pid = ready_pid(h.supervisor)
        start = h.supervisor.request_started(chat=True)  # an answer in flight
        h.supervisor.hold(WALL)
        assert not h.supervisor.availability().ready  # new requests wait from now on
        h.supervisor.request_ended(start)
        eventually(lambda: not h.supervisor.status.running)
        status = h.supervisor.status
        assert status.last_exit is not None
        assert status.last_exit.endswith(f": {WALL}")
        assert (status.failures, status.starts, status.critical) == (0, 1, None)  # a stop, not a death
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        h.supervisor.hold(None)
        assert ready_pid(h.supervisor) != pid
        assert h.supervisor.status.starts == 2
    finally:
        h.supervisor.stop(5.0)


def test_the_decision_to_wait_for_memory_reaches_the_supervisor() -> None:
    h = Harness(SLEEPER)
    engine = SupervisedEngine(Probe(), h.supervisor, h.desired)  # the engine's actuator
    decision = Policy().decide(Snapshot(), None, 0.0)
    engine.apply(decision.model_copy(update={"engine_wait": WALL}))
    assert h.supervisor.status.waiting == WALL
    assert h.desired.pause == WALL
    engine.apply(decision)
    assert h.supervisor.status.waiting is None
    assert h.desired.pause is None


class Probe:
    def observe(self) -> EngineObservation | None:
        return None
