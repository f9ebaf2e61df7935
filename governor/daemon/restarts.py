"""What the supervisor knows of its engine's deaths: the restart policy, the status it keeps, and the accounting of
one exit (back-off, a memory kill's cap one step smaller, safer settings after a crash, giving up), and what the
public socket tells a client from it. Pure bookkeeping: the supervisor (supervisor.py) holds the lock, the process and
the waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from governor.daemon.crashes import Crash, Phase, exit_name, explain, is_crash
from policies.decision import EngineConfig
from policies.ladder import ModelLadder

MIN_CTX = 256


class RestartPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    initial_s: float = Field(default=1.0, gt=0, le=3600)
    factor: float = Field(default=2.0, ge=1, le=10)
    max_s: float = Field(default=60.0, gt=0, le=86400)
    max_failures: int = Field(default=5, ge=1, le=1000)  # consecutive quick deaths before giving up (critical)
    stable_s: float = Field(default=60.0, gt=0, le=86400)  # an engine that lived this long resets the failure count
    oom_psi_some_avg10: float = Field(default=10.0, ge=0, le=100)  # PSI at a SIGKILL that counts as a memory kill
    ready_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    # A hung engine (stopped, deadlocked) is as dead as a crashed one: probed every probe_interval_s while it runs,
    # killed and restarted after hang_s without an answer. The engine writes a heartbeat line that often, and each
    # line wakes both processes: 5 s rather than 2 s is what keeps an idle daemon + engine under 0.05 s/min (issue 16).
    probe_interval_s: float = Field(default=5.0, gt=0, le=600)
    probe_timeout_s: float = Field(default=2.0, gt=0, le=600)
    hang_s: float = Field(default=10.0, gt=0, le=3600)

    def delay_s(self, failures: int) -> float:
        return float(min(self.max_s, self.initial_s * self.factor ** max(0, failures - 1)))


class Cap(BaseModel):
    """The largest engine the supervisor allows after a memory kill."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    n_ctx: int
    reason: str


@dataclass
class SupervisionStatus:
    running: bool = False
    ready: bool = False
    pid: int | None = None
    starts: int = 0
    failures: int = 0
    last_exit: str | None = None
    critical: str | None = None
    cap: Cap | None = None
    history: list[str] = field(default_factory=list)
    crashes: str | None = None  # the crash story so far (explain()), until a reload or a stable run
    tried: list[str] = field(default_factory=list)  # safer settings taken after crashes, in order
    extra_buffers: str | None = None  # "off" once a crash asked for it; None: the engine's own choice
    retry_at: float | None = None  # clock time of the next start while backing off
    stderr: str | None = None  # the last engine's last stderr line
    waiting: str | None = None  # "no tier fits in N MiB; waiting for memory": no engine until memory comes back


@dataclass(frozen=True)
class Availability:
    """What the public chat socket tells a client now: serve, wait, or 503 with this reason."""

    ready: bool
    given_up: bool  # given up, or the daemon is stopping: no point holding the request
    reason: str
    retry_after_s: int


def step_down(ladder: ModelLadder, config: EngineConfig) -> tuple[str, int] | None:
    """One step smaller: the next tier down, else half the context; None when nothing is smaller."""
    smaller = ladder.smaller(config.model)
    if smaller is not None:
        return smaller.name, min(config.n_ctx, smaller.n_ctx)
    if config.n_ctx // 2 >= MIN_CTX:
        return config.model, config.n_ctx // 2
    return None


@dataclass(frozen=True)
class Exit:
    """One engine's end. `returncode` None: it could not even start (`how` says why); `how` also says "hung ...,
    killed"; `evidence` is why it counts as a memory kill (crashes.memory_kill_evidence), if it does."""

    returncode: int | None
    lived_s: float
    config: EngineConfig
    how: str | None
    phase: Phase
    stderr: str | None
    evidence: str | None


def record_exit(
    st: SupervisionStatus, crashes: list[Crash], ended: Exit, restart: RestartPolicy, ladder: ModelLadder, *, now: float
) -> float | None:
    """Account one exit in `st` and the crash story `crashes`: the back-off before the next start, None when the
    engine is given up (`st.critical` says why)."""
    how, returncode, config, phase = ended.how, ended.returncode, ended.config, ended.phase
    if how is None and returncode is not None:
        how = f"killed by {exit_name(returncode)}" if returncode < 0 else f"exited with status {returncode}"
    quick = ended.lived_s < restart.stable_s
    st.failures = st.failures + 1 if quick else 1
    give_up = st.failures >= restart.max_failures
    st.stderr = ended.stderr
    st.last_exit = f"engine {how} after {ended.lived_s:.1f} s"
    if phase is not Phase.IDLE:
        st.last_exit += f", {phase}"
    if ended.evidence is not None:
        smaller = step_down(ladder, config)
        if smaller is not None:
            st.cap = Cap(model=smaller[0], n_ctx=smaller[1], reason=f"{ended.evidence}: {config.model}/{config.n_ctx}")
            st.last_exit += f"; {ended.evidence}; restarting one step smaller ({smaller[0]}, n_ctx {smaller[1]})"
    elif returncode is not None and is_crash(returncode):
        if not quick:
            crashes.clear()  # after a stable run, a crash starts a new story
        crashes.append(Crash(t=now, how=exit_name(returncode), phase=phase, tier=config.model))
        if phase in (Phase.LOAD, Phase.FIRST_DECODE) and not give_up:
            safer = _safer(st, ladder, config)
            if safer is not None:
                st.tried.append(safer)
                st.last_exit += f"; restarting with {safer}"
        st.crashes = explain(crashes, st.tried, ended.stderr)
    st.history = [*st.history[-9:], st.last_exit]
    if give_up:
        if crashes and st.crashes is not None:
            st.critical = st.crashes
        else:
            st.critical = f"engine failed {st.failures} times in a row, last: {st.last_exit}"
            if ended.stderr:
                st.critical += f"; last engine stderr: {ended.stderr}"
        st.retry_at = None
        return None
    delay = restart.delay_s(st.failures)
    st.retry_at = now + delay
    return delay


def _safer(st: SupervisionStatus, ladder: ModelLadder, config: EngineConfig) -> str | None:
    """The next safer setting after a crash at load or first decode: extra buffers off, then one step down the
    ladder (tier, else context). None when nothing safer is left."""
    if st.extra_buffers != "off":
        st.extra_buffers = "off"
        return "extra buffers off"
    smaller = step_down(ladder, config)
    if smaller is None:
        return None
    model, n_ctx = smaller
    st.cap = Cap(model=model, n_ctx=n_ctx, reason=f"engine crashes on {config.model}/{config.n_ctx}")
    return f"tier {model}" if model != config.model else f"n_ctx {n_ctx}"


def availability(
    st: SupervisionStatus, restart: RestartPolicy, load_s: float, now: float, stopping: bool
) -> Availability:
    """What the public chat socket tells a client now (`load_s`: how long a start is expected to take)."""
    if stopping:
        return Availability(False, True, "the governor is stopping", 5)
    if st.critical is not None:
        reason = f"the engine was given up (governor reload tries again): {st.critical}"
        return Availability(False, True, reason, math.ceil(restart.max_s))
    if st.waiting is not None:  # held: new requests wait (hold_s); an answer in flight is paused
        how = "paused" if st.running else "stopped"
        return Availability(False, False, f"the engine is {how}: {st.waiting}", math.ceil(restart.max_s))
    if st.ready:
        return Availability(True, False, "", 0)
    wait_s = load_s
    if st.running:
        reason = "the engine is loading" + (f" (restarted after: {st.last_exit})" if st.last_exit else "")
    elif st.retry_at is not None:
        backoff_s = max(0.0, st.retry_at - now)
        wait_s += backoff_s
        reason = f"the engine is restarting in {backoff_s:.0f} s after: {st.last_exit}"
    else:
        reason = "the engine has not started yet"
    if st.crashes:
        reason += f" ({st.crashes})"
    return Availability(False, False, reason, max(1, math.ceil(wait_s)))
