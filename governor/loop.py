"""The one loop: sample -> decide -> apply (every actuator, in order). The daemon runs it on a real clock, the lab on
a virtual one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import structlog

from governor.actuator import Actuator
from governor.clock import Clock, Wake
from policies.decision import Decision, Hold
from sensors.snapshot import EngineObservation, Snapshot


class SensorSource(Protocol):
    def sample(self) -> Snapshot: ...


class Decider(Protocol):
    """The policy core (`policies`): pure; its only inputs are these arguments."""

    def decide(
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, holds: Sequence[Hold] = ()
    ) -> Decision: ...

    def interval_s(self, decision: Decision) -> float:
        """How long until the next tick (shorter while mitigating, like the kernel's 100 ms / 1 s ticks)."""
        ...


class EngineObserver(Protocol):
    def observe(self) -> EngineObservation | None: ...


TickListener = Callable[[float, Snapshot, EngineObservation | None, Decision], None]


class GovernorLoop:
    def __init__(
        self,
        sensors: SensorSource,
        decider: Decider,
        engine: EngineObserver,
        clock: Clock,
        *,
        actuators: Sequence[Actuator] = (),
        wake: Wake | None = None,
        holds: Callable[[float], Sequence[Hold]] = lambda _t: (),
        listeners: Sequence[TickListener] = (),
        before_tick: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.sensors = sensors
        self.decider = decider
        self.engine = engine
        self.actuators = list(actuators)  # applied in this order after each decision
        self.clock = clock
        self._holds = holds
        self.listeners = list(listeners)
        self.before_tick = list(before_tick)  # run by `run()` between ticks: the daemon's reload
        self.last: Decision | None = None
        self.wake = wake if wake is not None else Wake()  # set by udev events, a reload, a hold, the engine: tick now
        self.max_wait_s: float | None = None  # never wait longer (systemd's watchdog wants a ping this often)
        self.wake_at: float | None = None  # a hook's one-off: wake by this clock time (a reload put off till then)
        self._log = structlog.get_logger("governor.loop")

    def tick(self) -> Decision:
        t = self.clock.now()
        snapshot = self.sensors.sample()
        observed = self.engine.observe()
        decision = self.decider.decide(snapshot, observed, t, self._holds(t))
        for actuator in self.actuators:
            actuator.apply(decision)
        if self.last is None or decision.state != self.last.state or decision.changed:
            self._log.info(
                "decision", state=decision.state.value, rule=decision.rule, reason=decision.reason, t=round(t, 3)
            )
        self.last = decision
        for listener in self.listeners:
            listener(t, snapshot, observed, decision)
        return decision

    def run(self, stop: threading.Event, on_error: Callable[[Exception], float] | None = None) -> None:
        """Tick until `stop` is set; a set `wake` cuts the wait short. `stop` should also set `wake`.

        `on_error` (the daemon's): an unexpected exception in a tick is handed to it and the loop carries on after
        the pause it returns; without it (the lab, tests) the exception propagates.
        """
        while not stop.is_set():
            try:
                for hook in self.before_tick:
                    hook()
                if stop.is_set():  # a hook took a stop signal: no tick after it
                    break
                decision = self.tick()
                interval = self.decider.interval_s(decision)
            except Exception as exc:
                if on_error is None:
                    raise
                interval = on_error(exc)
            if self.max_wait_s is not None:
                interval = min(interval, self.max_wait_s)
            if self.wake_at is not None:
                interval = min(interval, self.wake_at - self.clock.now())
                self.wake_at = None
            self.clock.wait(self.wake, interval)
            self.wake.clear()
