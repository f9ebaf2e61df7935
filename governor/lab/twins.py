"""The loop's views of a simulated `World` (governor/lab/world.py), the daemon's parts' twins: `SimulatedDevice` is a
SensorSource, `SimulatedEngine` the loop's view of the engine and its actuator, and the other actuators' twins
(`actuators()`), in the daemon's order."""

from __future__ import annotations

from typing import Any

from governor.actuator import Actuator
from governor.clock import Clock
from governor.lab.world import World
from policies.decision import Decision, EngineConfig
from sensors.snapshot import EngineObservation, Snapshot


class SimulatedDevice:
    """SensorSource: the same snapshots real sensors give, from the model."""

    def __init__(self, world: World, clock: Clock) -> None:
        self.world = world
        self.clock = clock

    def sample(self) -> Snapshot:
        self.world.advance_to(self.clock.now())
        return self.world.snapshot()


class SimulatedEngine:
    """The loop's view of the simulated engine (`observe`) and its actuator, as the daemon's SupervisedEngine is: the
    decision's settings (applied when they change) and its wait for memory (the engine is stopped, requests wait)."""

    name = "engine"

    def __init__(self, world: World, clock: Clock) -> None:
        self.world = world
        self.clock = clock
        self._applied: EngineConfig | None = None

    def observe(self) -> EngineObservation | None:
        self.world.advance_to(self.clock.now())
        engine = self.world.engine
        if engine.config is None:
            return None
        if engine.stopped:  # waiting for memory: no model loaded, requests queued (a paused process holds its runtime)
            return EngineObservation(
                busy=engine.busy(),
                model=None,
                loaded=False,
                threads=engine.config.threads,
                rss_bytes=engine.resident_bytes(),
                anon_bytes=engine.anon_bytes(),
            )
        return EngineObservation(
            busy=engine.busy(),
            tokens_per_s=engine.stats.take_rate(),
            model=engine.config.model,
            rss_bytes=engine.resident_bytes(),  # 0 while loading: the snapshot's available memory holds it all
            anon_bytes=engine.anon_bytes(),
            threads=engine.config.threads,
            context_tokens=round(engine.chat.ctx),
        )

    def apply(self, decision: Decision) -> None:
        if self.world.off_s is not None:  # the device is off: nothing to apply it to
            return
        if decision.engine != self._applied:
            self.world.engine.apply(decision.engine, self.world.t)
            self._applied = decision.engine
        self.world.engine.wait(decision.engine_wait, decision.t)

    def restore(self) -> None:
        pass  # the simulated process ends with the run

    def status(self) -> dict[str, Any]:
        config = self.world.engine.config
        return {"config": None if config is None else config.model_dump(), "pause": self.world.engine.waiting}


class SimulatedClock:
    """The clock cap actuator of a simulated device (the daemon's FreqCap): `scaling_max_freq` where writable."""

    name = "cpufreq"

    def __init__(self, world: World) -> None:
        self.world = world

    def apply(self, decision: Decision) -> None:
        self.world.set_cap(decision.freq_ratio)

    def restore(self) -> None:
        self.world.set_cap(None)

    def status(self) -> dict[str, Any]:
        return {"writable": self.world.device.cpu.freq_writable, "ratio": self.world.user_cap}


class SimulatedAffinity:
    """The thread placement actuator of a simulated device (the daemon's affinity actuator): the CPUs the engine's
    threads may run on."""

    name = "affinity"

    def __init__(self, world: World) -> None:
        self.world = world

    def apply(self, decision: Decision) -> None:
        self.world.engine.set_affinity(decision.affinity)

    def restore(self) -> None:
        self.world.engine.set_affinity(None)

    def status(self) -> dict[str, Any]:
        return {"cpus": self.world.engine.affinity}


def actuators(world: World, engine: SimulatedEngine) -> list[Actuator]:
    """The lab's actuators, each the simulated twin of the daemon's, in the daemon's order (governor.daemon.app)."""
    return [engine, SimulatedClock(world), SimulatedAffinity(world)]
