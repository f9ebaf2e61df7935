"""GovernorLoop on a VirtualClock with small fakes: what the daemon and the lab both rely on."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from governor.clock import VirtualClock, Wake
from governor.loop import GovernorLoop
from policies.decision import Decision, EngineConfig, Hold, State
from sensors.snapshot import EngineObservation, Snapshot, Temperature


class Sensors:
    def __init__(self) -> None:
        self.temp_c = 50.0

    def sample(self) -> Snapshot:
        zone = Temperature(source="thermal_zone0", kind="simulated", label="cpu", temp_c=self.temp_c)
        return Snapshot(temperatures=(zone,))


class Threshold:
    """Hot above 70 °C: 2 threads, else 4; a hold's max_threads caps it. Ticks every 1 s, 0.25 s when hot."""

    def __init__(self) -> None:
        self.holds_seen: list[tuple[Hold, ...]] = []

    def decide(
        self, snapshot: Snapshot, engine: EngineObservation | None, t: float, holds: Sequence[Hold] = ()
    ) -> Decision:
        self.holds_seen.append(tuple(holds))
        temp = snapshot.temperatures[0].temp_c or 0.0
        hot = temp > 70
        threads = min([2 if hot else 4, *(h.max_threads for h in holds if h.max_threads)])
        config = EngineConfig(threads=threads, n_ctx=1024, model="m")
        state = State.HOT if hot else State.IDLE
        return Decision(t=t, state=state, engine=config, reason=f"{state.value}: {temp:.0f} °C", rule="r")

    def interval_s(self, decision: Decision) -> float:
        return 0.25 if decision.state == State.HOT else 1.0


class Engine:
    """The loop's view of the engine and an actuator that keeps the settings it was given when they change."""

    name = "engine"

    def __init__(self, log: list[str] | None = None) -> None:
        self.applied: list[EngineConfig] = []
        self.log = log if log is not None else []

    def observe(self) -> EngineObservation:
        return EngineObservation(busy=True)

    def apply(self, decision: Decision) -> None:
        self.log.append(self.name)
        if not self.applied or self.applied[-1] != decision.engine:
            self.applied.append(decision.engine)

    def restore(self) -> None:
        self.applied.clear()

    def status(self) -> dict[str, Any]:
        return {"applied": len(self.applied)}


class Clock(Engine):
    name = "clock"


def test_every_actuator_gets_every_decision_in_the_order_given_before_the_listeners() -> None:
    sensors, order = Sensors(), list[str]()
    engine, clock = Engine(order), Clock(order)
    loop = GovernorLoop(
        sensors,
        Threshold(),
        engine,
        VirtualClock(),
        actuators=[engine, clock],
        listeners=[lambda *_: order.append("l")],
    )
    loop.tick()
    loop.tick()
    sensors.temp_c = 80
    loop.tick()
    assert order == ["engine", "clock", "l"] * 3
    assert [c.threads for c in engine.applied] == [4, 2]  # each actuator does nothing when nothing changed


def test_run_waits_the_deciders_interval_and_runs_hooks_between_ticks() -> None:
    sensors, engine, clock = Sensors(), Engine(), VirtualClock()
    stop = threading.Event()
    times: list[float] = []
    hooks: list[float] = []

    def listener(t: float, _s: Snapshot, _o: EngineObservation | None, _d: Decision) -> None:
        times.append(t)
        if len(times) == 3:
            sensors.temp_c = 80  # hot from the 4th tick: 0.25 s ticks
        if len(times) == 6:
            stop.set()

    loop = GovernorLoop(
        sensors, Threshold(), engine, clock, listeners=[listener], before_tick=[lambda: hooks.append(clock.now())]
    )
    loop.run(stop)
    assert times == [0.0, 1.0, 2.0, 3.0, 3.25, 3.5]
    assert hooks == times


def test_holds_in_force_reach_the_decider_and_wake_cuts_the_wait() -> None:
    decider, engine, clock = Threshold(), Engine(), VirtualClock()
    held: list[Hold] = []
    loop = GovernorLoop(Sensors(), decider, engine, clock, actuators=[engine], holds=lambda _t: tuple(held))
    loop.tick()
    held.append(Hold(owner="pid 1 uid 0", max_threads=1))
    loop.wake.set()  # what a new hold does: the wait ends at once, no virtual time passes
    assert clock.wait(loop.wake, 1.0) is True
    assert clock.now() == 0.0
    loop.tick()
    assert decider.holds_seen[-1] == tuple(held)
    assert [c.threads for c in engine.applied] == [4, 1]


class Flaky(Engine):
    """An engine link that raises something nobody expected on some ticks."""

    def __init__(self, fail_on: set[int]) -> None:
        super().__init__()
        self.fail_on, self.calls = fail_on, 0

    def observe(self) -> EngineObservation:
        self.calls += 1
        if self.calls in self.fail_on:
            raise OverflowError("cannot convert float infinity to integer")
        return super().observe()


def test_an_unexpected_error_costs_one_tick_when_the_daemon_asks_for_that() -> None:
    engine, clock, stop = Flaky({2, 3}), VirtualClock(), threading.Event()
    errors: list[Exception] = []
    times: list[float] = []

    def listener(t: float, _s: Snapshot, _o: EngineObservation | None, _d: Decision) -> None:
        times.append(t)
        if len(times) == 3:
            stop.set()

    def on_error(exc: Exception) -> float:
        errors.append(exc)
        return 5.0

    GovernorLoop(Sensors(), Threshold(), engine, clock, listeners=[listener]).run(stop, on_error=on_error)
    assert [type(e) for e in errors] == [OverflowError, OverflowError]
    assert times == [0.0, 11.0, 12.0]  # tick, two failures 5 s apart, then ticking again


def test_without_an_error_handler_the_error_propagates() -> None:
    loop = GovernorLoop(Sensors(), Threshold(), Flaky({1}), VirtualClock())
    with pytest.raises(OverflowError):  # the lab and tests must see a bug, not a loop that hides it
        loop.run(threading.Event())


def test_max_wait_caps_the_interval_for_the_watchdog() -> None:
    clock, stop = VirtualClock(), threading.Event()
    times: list[float] = []

    def listener(t: float, _s: Snapshot, _o: EngineObservation | None, _d: Decision) -> None:
        times.append(t)
        if len(times) == 4:
            stop.set()

    loop = GovernorLoop(Sensors(), Threshold(), Engine(), clock, listeners=[listener])
    loop.max_wait_s = 0.4  # systemd wants a ping every 0.4 s; the decider would wait 1 s
    loop.run(stop)
    assert [round(t, 6) for t in times] == [0.0, 0.4, 0.8, 1.2]


def test_the_loops_wake_behaves_as_an_event_for_its_one_waiter() -> None:
    wake = Wake()
    assert wake.wait(0.0) is False
    wake.set()
    wake.set()  # twice before anyone waited: no error, one wake
    assert wake.is_set()
    assert wake.wait(0.0) is True
    assert wake.wait(0.0) is True  # stays set until cleared, as an Event does
    wake.clear()
    assert wake.wait(0.0) is False
    waiting = threading.Thread(target=lambda: results.append(wake.wait(60.0)))
    results: list[bool] = []
    waiting.start()
    threading.Timer(0.05, wake.set).start()  # from another thread, as udev, a reload or a hold does
    waiting.join(60.0)
    assert results == [True]
    wake.clear()
    wake.set()
    wake.clear()  # a set undone before the wait: the wait times out
    assert wake.wait(0.01) is False
