"""The engine child: started from the first decision, restarted with back-off, stepped down after a memory kill or
a crash loop, given up (and said why) when nothing works.

A crash (a crash signal or a non-zero exit) during load or in the first decode is retried on a safer setting each
time: first the engine's extra buffer types off (llama.cpp's AMX/repack paths, the usual native crash), then one
step down the ladder, and so on until `max_failures`. `governor.daemon.crashes` words it.

Supervision feeds the policy through `SupervisedDecider` (governor.daemon.engine), which adds inputs and never
rewrites a decision: after a memory kill or a crash a hold of its own caps the model tier / context one step below what
died (until a reload), and after repeated failures the engine's observation says it was given up (the policy goes
critical and says why). So the decision and its reason are what the engine runs. The policy itself stays pure and
unaware of processes.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable, Sequence

import structlog
from pydantic import BaseModel

from governor.clock import Clock
from governor.daemon.crashes import (
    Crash,
    Phase,
    StderrTail,
    memory_kill_evidence,
    phase_of,
    read_kernel_log,
    terminate,
    wait_exit,
)
from governor.daemon.desired import DesiredEngine
from governor.daemon.restarts import Availability, Exit, RestartPolicy, SupervisionStatus, availability, record_exit
from policies.decision import EngineConfig, Hold
from policies.ladder import ModelLadder
from sensors.snapshot import Snapshot

HELD = "held"  # _watch: the engine was stopped because nothing fits in memory (not a death)
LOAD_GUESS_S = 5.0  # until an engine has come up once, how long a start is expected to take (for Retry-After)


class EngineSupervisor:
    def __init__(
        self,
        *,
        command: Callable[[EngineConfig, str | None], Sequence[str]],
        ready: Callable[[float], BaseModel | None],
        desired: DesiredEngine,
        ladder: ModelLadder,
        restart: RestartPolicy,
        clock: Clock,
        latest_snapshot: Callable[[], Snapshot | None] = lambda: None,
        on_change: Callable[[], None] = lambda: None,
        kernel_log: Callable[[], str | None] = read_kernel_log,
        probe: Callable[[float], BaseModel | None] | None = None,
    ) -> None:
        """`command(config, extra_buffers)` is the child's argv (`extra_buffers` "off" after a crash asked for the
        safer setting, else None); `ready(timeout_s)` waits for its socket and gives the status of the engine
        answering there (None: none answers); `probe(timeout_s)` gives a running engine's latest status (None:
        silent); a status names its `pid`, which must be our child's. `desired` owns the config an engine starts with
        and converges a ready one to it (no probe: a running child always answers)."""
        self._command, self._ready, self.desired, self._probe = command, ready, desired, probe
        self.ladder, self.restart, self.clock = ladder, restart, clock
        self._latest_snapshot, self._on_change, self._kernel_log = latest_snapshot, on_change, kernel_log
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hurry = False  # a plain attribute: set from a signal handler, which must take no lock
        self._retry = threading.Event()
        self._resume = threading.Event()  # set when the wait for memory ends (or the daemon stops)
        self._restarting = False  # the running engine was stopped to start again with new settings (not a death)
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.status = SupervisionStatus()
        self._crashes: list[Crash] = []
        self._requests = self._answered = 0  # chat requests the public socket sent to this engine / it answered
        self._exits: dict[int, str] = {}  # start number -> how that engine ended (for the proxy's error)
        self._load_s = LOAD_GUESS_S
        self._log = structlog.get_logger("governor.supervisor")

    # -- called by the daemon --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Supervise from now on: the first engine starts once the owner of the desired config has one."""
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)
        self._thread.start()

    def expect_exit(self) -> None:
        """The daemon is stopping: an engine exit from now on is not a death to restart from. (A terminal's Ctrl-C
        reaches the engine too, being in the same process group, and it drains itself on SIGINT.)"""
        self._stop.set()

    def hold(self, waiting: str | None) -> None:
        """Nothing fits in memory (`waiting` says so): once no answer is in flight, stop the engine, and start none
        until memory comes back (None), rather than restart it into the OOM killer again and again. (An answer in
        flight is paused meanwhile, the engine's model unloaded: governor.daemon.desired.)"""
        with self._lock:
            was, self.status.waiting = self.status.waiting, waiting
        if waiting is None and was is not None:
            self._log.info("memory is back; starting the engine")
            self._resume.set()
        elif waiting is not None and was is None:
            self._log.warning("engine held", reason=waiting)
        if (waiting is None) != (was is None):
            self._on_change()

    def restart_engine(self) -> None:
        """Stop the running engine (it drains its answer, as on SIGTERM) to start it again at once with the desired
        settings: its driver can change them no other way. Not a death: no back-off, no failure counted."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None or self._stop.is_set():
                return
            self._restarting = True
        proc.send_signal(signal.SIGTERM)

    def reset(self) -> None:
        """A reload forgets past failures, caps and safer settings and retries a given-up engine."""
        with self._lock:
            st = self.status
            st.failures, st.critical, st.cap, st.crashes, st.tried, st.extra_buffers = 0, None, None, None, [], None
            self._crashes = []
        self._on_change()  # the policy decides again without the cap (the restart takes what it decides)
        self._retry.set()

    # -- the supervising thread -----------------------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._supervise_once():
                    return
            except Exception as exc:  # a bug must not end supervision: say so, back off, try again
                self._log.error("supervision failed; retrying", exc_info=exc)
                with self._lock:
                    self.status.last_exit = f"supervision failed: {type(exc).__name__}: {exc}"[:400]
                self._stop.wait(self.restart.initial_s)

    def _supervise_once(self) -> bool:
        """Start the engine, watch it until it exits; False when there is nothing (more) to supervise."""
        config = self._allowed_desired()
        if config is None:
            return False
        if self.status.waiting is not None:
            self._resume.wait(self.restart.probe_interval_s)
            self._resume.clear()
            return True
        argv = list(self._command(config, self.status.extra_buffers))
        started = self.clock.now()
        try:
            # stderr through a pipe: copied to ours line by line, its last line kept for the crash story
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError as exc:  # e.g. EMFILE (out of file descriptors) or EAGAIN: a failed start, retried
            self._log.error("engine could not start", error=str(exc))
            self._after_exit(
                None, 0, 0.0, config, how=f"could not start ({exc.strerror or exc})", phase=Phase.LOAD, stderr=None
            )
            return True
        assert proc.stderr is not None
        tail = StderrTail(proc.stderr)
        with self._lock:
            self._proc = proc
            st = self.status
            st.running, st.ready, st.pid, st.retry_at = True, False, proc.pid, None
            st.starts += 1
            self._requests = self._answered = 0
        self._log.info(
            "engine started",
            pid=proc.pid,
            model=config.model,
            threads=config.threads,
            extra_buffers=self.status.extra_buffers,
        )
        was_ready = self._wait_ready(proc, config)
        if was_ready:
            self._load_s = max(0.5, self.clock.now() - started)
            self._on_change()
        returncode, hung = self._watch(proc)
        self.desired.engine_gone()
        with self._lock:
            self.status.running, self.status.ready, self.status.pid = False, False, None
            phase = phase_of(was_ready=was_ready, requests=self._requests, answered=self._answered)
            restarting, self._restarting = self._restarting, False
        if self._stop.is_set():
            return False
        if restarting:
            self._log.info("engine stopped to take new settings; starting it again", returncode=returncode)
            self._on_change()
            return True
        lived_s = self.clock.now() - started
        if hung == HELD:
            with self._lock:
                self.status.last_exit = f"engine stopped after {lived_s:.1f} s: {self.status.waiting or 'memory'}"
                self.status.history = [*self.status.history[-9:], self.status.last_exit]
            self._log.info("engine stopped while nothing fits in memory", reason=self.status.last_exit)
            self._on_change()
            return True
        self._after_exit(returncode, proc.pid, lived_s, config, how=hung, phase=phase, stderr=tail.last())
        return True

    def _allowed_desired(self) -> EngineConfig | None:
        """The desired config, once there is one within the cap (after a memory kill or a crash the policy honours
        the cap hold at its next tick, which `on_change` asked for); None when the daemon stops."""
        while not self._stop.is_set():
            config = self.desired.wait_for(self._allows, 1.0)
            if config is not None:
                return config
        return None

    def _allows(self, config: EngineConfig) -> bool:
        cap = self.status.cap
        if cap is None:
            return True
        names = [t.name for t in self.ladder.tiers]
        smaller = config.model not in names or names.index(config.model) >= names.index(cap.model)
        return smaller and config.n_ctx <= cap.n_ctx

    def _watch(self, proc: subprocess.Popen[bytes]) -> tuple[int, str | None]:
        """Wait for the child to exit; kill it once it has not answered a probe for `hang_s` (e.g. SIGSTOPped)."""
        silent_since: float | None = None
        probing = self.status.ready  # an engine that never became ready was killed by _wait_ready already
        while True:
            try:
                return wait_exit(proc, self.restart.probe_interval_s), None
            except subprocess.TimeoutExpired:
                pass
            with self._lock:
                idle = self._requests <= self._answered
            if self.status.waiting is not None and idle and not self._stop.is_set():
                return terminate(proc, self.restart.hang_s), HELD  # nothing in flight: stop now, no answer is cut
            if self._stop.is_set() or not probing:
                continue
            answers = self._answers(proc.pid)
            if answers == (silent_since is not None):  # it stopped answering, or answers again
                with self._lock:
                    self.status.ready = answers  # status says "not answering" while it is silent
                self._log.warning("engine answers again" if answers else "engine does not answer", pid=proc.pid)
                self._on_change()
            if answers:
                silent_since = None
                continue
            now = self.clock.now()
            silent_since = now if silent_since is None else silent_since
            if now - silent_since >= self.restart.hang_s:
                silent = now - silent_since + self.restart.probe_timeout_s
                self._log.error("engine hung; killing it", pid=proc.pid, silent_s=round(silent, 1))
                proc.kill()
                return proc.wait(), f"hung (no answer for {silent:.0f} s), killed"

    def _wait_ready(self, proc: subprocess.Popen[bytes], config: EngineConfig) -> bool:
        deadline = self.clock.now() + self.restart.ready_timeout_s
        while proc.poll() is None and not self._stop.is_set():
            answering = self._ready(min(1.0, max(0.0, deadline - self.clock.now())))
            if answering is not None and self._ours(answering, proc.pid):
                with self._lock:
                    self.status.ready = True
                    start = self.status.starts
                self.desired.engine_ready(start, config, self.restart_engine)  # what was decided meanwhile goes to it
                self._log.info("engine ready", pid=proc.pid)
                return True
            if self.clock.now() > deadline:
                self._log.error("engine not ready in time; killing it", timeout_s=self.restart.ready_timeout_s)
                proc.kill()
                return False
        return False

    def _answers(self, pid: int | None) -> bool:
        """The running engine answers: its latest status came within a probe's time, from our child; the owner of
        the settings compares it with what it wants (drift). No probe: it always answers."""
        if self._probe is None:
            return True
        status = self._probe(self.restart.probe_timeout_s)
        if status is None or not self._ours(status, pid):
            return False
        self.desired.check(status)
        return True

    def _ours(self, status: BaseModel, pid: int | None) -> bool:
        """The engine answering is our child: another daemon's engine on the same socket is never taken over."""
        reported = (status.model_extra or {}).get("pid")  # a status without one: not ours
        if reported == pid:
            return True
        self._log.error("another engine answers on our socket; not using it", pid=reported, ours=pid)
        return False

    def _after_exit(
        self,
        returncode: int | None,
        pid: int,
        lived_s: float,
        config: EngineConfig,
        *,
        how: str | None,
        phase: Phase,
        stderr: str | None,
    ) -> None:
        """`returncode` None: it could not even start (`how` says why); `how` also says "hung ..., killed"."""
        evidence = (
            None
            if returncode is None
            else memory_kill_evidence(
                returncode, pid, self._latest_snapshot(), self.restart.oom_psi_some_avg10, self._kernel_log
            )
        )
        ended = Exit(returncode, lived_s, config, how, phase, stderr, evidence)
        with self._lock:
            delay = record_exit(self.status, self._crashes, ended, self.restart, self.ladder, now=self.clock.now())
            if delay is None:
                self._retry.clear()  # before `critical` is visible: a reset from now on is a retry
            self._exits[self.status.starts] = self.status.last_exit or ""
            self._exits.pop(self.status.starts - 10, None)
        if delay is None:
            self._log.error("engine given up", reason=self.status.critical)
            self._on_change()
            while not self._stop.is_set() and not self._retry.wait(1.0):
                pass
            return
        self._log.warning(
            "engine died; restarting", reason=self.status.last_exit, delay_s=round(delay, 2), stderr=stderr
        )
        self._on_change()
        self._stop.wait(delay)

    # -- for the public chat socket (governor.daemon.proxy) ---------------------------------------------------------
    def availability(self) -> Availability:
        now, stopping = self.clock.now(), self._stop.is_set()
        with self._lock:
            return availability(self.status, self.restart, self._load_s, now=now, stopping=stopping)

    def request_started(self, *, chat: bool) -> int:
        """A request goes to the engine; returns the engine's start number for `request_ended`/`exit_of`. Chat
        requests count towards the death's phase (`in the first decode`)."""
        with self._lock:
            self._requests += chat
            return self.status.starts

    def request_ended(self, start: int, *, answered: bool = True) -> None:
        """That request ended; `answered` (or its client left): the engine is past its first decode."""
        with self._lock:
            if answered and start == self.status.starts:
                self._answered += 1

    def exit_of(self, start: int) -> str | None:
        """How the engine of that start ended, once the supervisor has seen it die."""
        with self._lock:
            return self._exits.get(start)

    # -- for the decision ---------------------------------------------------------------------------------------
    def caps(self) -> tuple[Hold, ...]:
        """The supervisor's word as the policy's input: its cap on the model tier and context, while there is one."""
        cap = self.status.cap
        if cap is None:
            return ()
        return (Hold(owner=cap.reason[:200], max_tier=cap.model, max_ctx=cap.n_ctx),)

    @property
    def pid(self) -> int | None:
        return self.status.pid

    @property
    def ready(self) -> bool:
        return self.status.ready

    def hurry(self) -> None:
        """A second Ctrl-C / SIGTERM while stopping: `stop` ends the running answer now instead of draining it.
        (Sets a flag only: called from the signal handler.)"""
        self._hurry = True

    def stop(self, timeout_s: float) -> None:
        """SIGTERM (the engine lets the running answer finish for its drain time, then stops it at a token
        boundary), then SIGKILL after `timeout_s`. After `hurry()`, a second SIGTERM: the engine ends it now."""
        self._stop.set()
        self._retry.set()
        self._resume.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            deadline, hurried = self.clock.now() + timeout_s, False
            while True:
                try:
                    wait_exit(proc, 0.2)  # in slices: a second signal must be seen during the drain
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self._hurry and not hurried:
                    hurried = True
                    self._log.warning("stopping now: the running answer ends at the next token")
                    proc.send_signal(signal.SIGTERM)
                if self.clock.now() > deadline:
                    self._log.warning("engine did not stop in time; killing it", timeout_s=timeout_s)
                    proc.kill()
                    proc.wait()
                    break
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
