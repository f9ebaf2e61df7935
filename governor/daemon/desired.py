"""The one owner of what the engine should run, and the one path that converges the running engine to it.

What the engine should run is the latest decision's settings (`EngineConfig`) and its memory pause (`engine_wait`:
nothing fits, hold the model unloaded). Everyone else asks this object: the supervisor starts an engine with its
config (the command line is the same message, as flags) and tells it when that engine is ready; the loop's engine
actuator (governor.daemon.actuators) sets it; the supervisor's probe hands it the status the engine pushed, to compare
(drift). One thread then sends the engine one idempotent message — the whole config — whenever the running engine may
differ from it: a new decision, a new engine ready, a drift. Never the loop's thread: a model or context change makes
the engine reload at a token boundary, which can take seconds; older configs not yet sent are skipped. A change the
engine's driver can make only by a restart (governor.daemon.driver.Capabilities) asks the supervisor to restart it
instead: it starts again with the config it then asks for here.

The pause goes the same way, first (memory is what the device lacks then): the engine unloads its model at the next
token boundary and the answer waits with its client's stream open; resumed, it loads again and goes on. A new engine
process starts unpaused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from pydantic import BaseModel

from govbase.errors import GovernorError
from governor.daemon.driver import Capabilities
from policies.decision import EngineConfig


class EngineLink(Protocol):
    """How a running engine is told (an engine driver: governor.daemon.driver)."""

    @property
    def capabilities(self) -> Capabilities: ...

    def apply(self, config: EngineConfig) -> None: ...

    def pause(self, reason: str | None) -> None: ...

    def prepare_restart(self, config: EngineConfig) -> None: ...


class DesiredEngine:
    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self._cond = threading.Condition()
        self.config: EngineConfig | None = None
        self.pause: str | None = None
        self._engine: int | None = None  # the start number of the engine that is ready, else None
        self._running: EngineConfig | None = None  # what that engine runs: started with, or last taken
        self._restart: Callable[[], None] = _nothing  # how to restart it (the supervisor's)
        self._sent: tuple[int | None, EngineConfig | None] = (None, None)  # (engine, config) it was sent last
        self._told: tuple[int | None, str | None] = (None, None)  # (engine, pause) it was told last
        self._again = False  # the engine drifted: send the config again even though it was sent
        self._in_flight = False
        self._closing = False
        self._agreed: tuple[object, EngineConfig | None] = (None, None)  # the status and config last found to agree
        self._log = structlog.get_logger("governor.engine")
        self._thread = threading.Thread(target=self._converge, name="engine-settings", daemon=True)
        self._thread.start()

    # -- what the engine should run (the loop's engine actuator) -------------------------------------------------
    def want(self, config: EngineConfig, pause: str | None) -> None:
        with self._cond:
            if config == self.config and pause == self.pause:
                return
            self.config, self.pause = config, pause
            self._cond.notify_all()

    def wait_for(self, allowed: Callable[[EngineConfig], bool], timeout_s: float) -> EngineConfig | None:
        """The config once there is one `allowed` (the supervisor's cap), or None after `timeout_s`."""
        with self._cond:
            self._cond.wait_for(lambda: self.config is not None and allowed(self.config), timeout_s)
            config = self.config
            return config if config is not None and allowed(config) else None

    # -- the engine's life (the supervisor) and its pushed status (the probe) -----------------------------------
    def engine_ready(self, start: int, running: EngineConfig, restart: Callable[[], None]) -> None:
        """Engine number `start` answers, started with `running`: converge it (the decision may have changed while
        it loaded); `restart()` restarts it, for a change its driver cannot make otherwise."""
        with self._cond:
            self._engine, self._running, self._restart = start, running, restart
            self._cond.notify_all()

    def engine_gone(self) -> None:
        with self._cond:
            self._engine, self._running, self._restart = None, None, _nothing

    def check(self, running: BaseModel) -> None:
        """The engine runs other settings than wanted (someone posted to its /engine/config): log the drift and send
        ours again. Not while a config is on its way to it (the engine may be half way there). An idle engine's
        heartbeat repeats its last status object: a status found to agree is not compared again."""
        desired = self.config
        if self._agreed[0] is running and self._agreed[1] is desired:
            return
        with self._cond:
            if desired is None or self._in_flight or self._due() or self._closing:
                return
            fields = running.model_dump()
            drift = {k: [fields.get(k), v] for k, v in desired.model_dump().items() if fields.get(k) != v}
            if not drift:
                self._agreed = (running, desired)
                return
            self._again = True
            self._cond.notify_all()
        self._log.warning("engine config drifted (engine, ours); applying ours again", drift=drift)

    def status(self) -> dict[str, Any]:
        with self._cond:
            engine, sent = self._sent
            return {
                "driver": self.link.capabilities.as_dict(),
                "config": None if self.config is None else self.config.model_dump(),
                "pause": self.pause,
                "converged": self._engine is not None and engine == self._engine and sent == self.config,
            }

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(5.0)

    # -- the converging thread ------------------------------------------------------------------------------------
    def _due(self) -> bool:
        """The ready engine may run something else than wanted (lock held)."""
        if self._engine is None or self.config is None:
            return False
        told = self._told[1] if self._told[0] == self._engine else None  # a new process starts unpaused
        return self._again or self._sent != (self._engine, self.config) or told != self.pause

    def _converge(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or self._due())
                if self._closing:
                    return
                engine, config, pause, running = self._engine, self.config, self.pause, self._running
                told = self._told[1] if self._told[0] == engine else None
                send = self._again or self._sent != (engine, config)
                # Once each: a failure is logged, and the next decision, engine or drift sends again.
                self._sent, self._told, self._again = (engine, config), (engine, pause), False
                self._in_flight = True
                restart = self._restart
            try:
                if (
                    config is not None
                    and running is not None
                    and self.link.capabilities.how(running, config) == "restart"
                ):
                    self._log.info("restarting the engine for settings it cannot change running", **config.model_dump())
                    self._prepare(config)  # e.g. llama-server saves the conversation (after the answer in progress)
                    restart()  # it starts again with the config asked for then; ready, it is sent again
                    with self._cond:
                        if self._engine == engine:  # it is stopping: nothing more goes to it (a newer config
                            self._engine, self._running = None, None  # waits for the next engine's start)
                    continue
                if pause != told:
                    self._tell(pause)
                if send and config is not None and self._send(config):
                    with self._cond:
                        if self._engine == engine:
                            self._running = config
            except Exception as exc:  # a bug or an engine's garbage must not end convergence: the next change retries
                self._log.error("engine settings not sent", exc_info=exc)
            finally:
                with self._cond:
                    self._in_flight = False

    def _prepare(self, config: EngineConfig) -> None:
        try:
            self.link.prepare_restart(config)
        except (GovernorError, OSError) as exc:  # the restart goes ahead: the conversation is evaluated again
            self._log.warning("engine not prepared for its restart", error=str(exc))

    def _tell(self, pause: str | None) -> None:
        try:
            self.link.pause(pause)
        except (GovernorError, OSError) as exc:  # e.g. it is being stopped (a new one starts unpaused)
            self._log.warning("engine did not take the pause", error=str(exc), reason=pause)

    def _send(self, config: EngineConfig) -> bool:
        try:
            self.link.apply(config)
        except (GovernorError, OSError) as exc:  # refused or unreachable: the next decision or restart retries
            self._log.warning("engine did not take the config", error=str(exc), **config.model_dump())
            return False
        return True


def _nothing() -> None:
    pass
