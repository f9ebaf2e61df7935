"""The engine as the loop sees it and acts on it: the supervised child process, its pushed status, and the owner of
its desired settings (governor.daemon.desired); and the policy core fed what the supervisor knows (SupervisedDecider:
its cap as a hold, a given-up engine on the observation, never a rewritten decision).

`observe()` does no I/O when a watch is given: the engine pushes its status on change (governor/daemon/watch.py).
`apply(decision)` is the engine's actuator: while nothing fits in memory (the decision's `engine_wait`) the supervisor
holds the process (stops an idle engine, starts none), and the owner is given the decision's settings and pause; it
never blocks the loop (the owner's own thread sends them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from governor.daemon.desired import DesiredEngine
from governor.daemon.supervisor import EngineSupervisor
from governor.loop import Decider
from policies.decision import Decision, Hold
from sensors.psutil_backend import ProcessStats
from sensors.snapshot import EngineObservation, Snapshot


class EngineObserver(Protocol):
    """The engine client, as the daemon reads it without a watch (governor.engine.client.EngineClient)."""

    def observe(self) -> EngineObservation | None: ...


class Watch(Protocol):
    """governor.daemon.watch.EngineWatch: the engine's last pushed status, or None while not connected."""

    @property
    def latest(self) -> EngineObservation | None: ...


class SupervisedEngine:
    """The loop's view of the engine (`observe`) and its actuator (`apply`, `restore`, `status`)."""

    name = "engine"

    def __init__(
        self, link: EngineObserver, supervisor: EngineSupervisor, desired: DesiredEngine, watch: Watch | None = None
    ) -> None:
        self.link = link
        self.supervisor = supervisor
        self.desired = desired
        self.watch = watch
        self._stats: ProcessStats | None = None

    def observe(self) -> EngineObservation | None:
        if not self.supervisor.ready:
            return None
        observed = self.watch.latest if self.watch is not None else self.link.observe()
        pid = self.supervisor.pid
        if observed is not None and observed.rss_bytes is None and pid is not None:
            # An engine that does not report its RSS: read it from outside (psutil), one ProcessStats per child.
            if self._stats is None or self._stats.pid != pid:
                self._stats = ProcessStats(pid)
            observed = observed.model_copy(update={"rss_bytes": self._stats.sample().rss_bytes})
        return observed

    def apply(self, decision: Decision) -> None:
        self.supervisor.hold(decision.engine_wait)  # first: an engine must not start into a wait for memory
        self.desired.want(decision.engine, decision.engine_wait)

    def restore(self) -> None:
        """Nothing to put back (the engine is stopped before the restore phase): the owner's thread ends."""
        self.desired.close()

    def status(self) -> dict[str, Any]:
        return self.desired.status()


class SupervisedDecider:
    """The policy core, fed what the supervisor knows: its cap as a hold, a given-up engine on the observation."""

    def __init__(self, inner: Decider, supervisor: EngineSupervisor) -> None:
        self.inner = inner  # swapped on reload
        self.supervisor = supervisor

    def decide(
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, holds: Sequence[Hold] = ()
    ) -> Decision:
        critical = self.supervisor.status.critical
        if critical is not None:
            given_up = {"given_up": critical}
            engine = EngineObservation(busy=False, **given_up) if engine is None else engine.model_copy(update=given_up)
        return self.inner.decide(snapshot, engine, t, (*holds, *self.supervisor.caps()))

    def interval_s(self, decision: Decision) -> float:
        return self.inner.interval_s(decision)
