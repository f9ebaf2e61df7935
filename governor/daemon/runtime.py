"""The running daemon: signals, reload, readiness, the control API, and the phased shutdown.

Everything is built elsewhere (`governor.daemon.app.build`) and passed in. Signal handlers only record the signal and
wake the loop (governor/daemon/signals.py); the loop's thread stops or reloads between ticks, and the main thread shuts
down after the loop returns.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, TimeoutError
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from govbase.errors import GovernorError
from governor.clock import Clock
from governor.daemon.config import DaemonConfig
from governor.daemon.controlserver import ControlServer
from governor.daemon.engine import SupervisedDecider, SupervisedEngine
from governor.daemon.holds import HoldRegistry
from governor.daemon.metrics import DaemonMetrics
from governor.daemon.notify import Notifier
from governor.daemon.signals import SignalInbox
from governor.daemon.state import DaemonState
from governor.daemon.supervisor import EngineSupervisor
from governor.loop import Decider, GovernorLoop
from policies.decision import Decision, Hold, State
from sensors.snapshot import EngineObservation, Snapshot, TraceRecord

if TYPE_CHECKING:
    from governor.daemon.publicsocket import ProxyServer  # built (and uvicorn imported) by app.build
    from governor.daemon.routing import Router

RELOAD_WAIT_S = 30.0
# SIGHUPs closer together than this make one reload at the end of the gap: a storm of them costs two reloads a
# second, and a lone one is taken at once (the loop is woken for it).
RELOAD_SPACING_S = 0.5
ERROR_PAUSE_S = 1.0  # after a tick that failed unexpectedly, the next try comes this much later
# systemd's STATUS= line: a new state at once, a new reason in the same state at most this often. While mitigating
# the reason changes every 0.25 s tick (the temperature, the PI output), and each message wakes PID 1.
STATUS_EVERY_S = 5.0


class Closeable(Protocol):
    def close(self) -> None: ...


class Events(Protocol):
    def start(self) -> bool: ...

    def stop(self) -> None: ...


class Daemon:
    def __init__(
        self,
        *,
        config: DaemonConfig,
        clock: Clock,
        loop: GovernorLoop,
        decider: SupervisedDecider,
        load_decider: Callable[[str], Decider],
        supervisor: EngineSupervisor,
        engine: SupervisedEngine,
        proxy: ProxyServer,
        holds: HoldRegistry,
        state: DaemonState,
        metrics: DaemonMetrics,
        notifier: Notifier,
        events: Events | None,
        closeables: tuple[Closeable, ...] = (),
        router: Router | None = None,
    ) -> None:
        self.config, self.clock, self.loop = config, clock, loop
        self.decider, self._load_decider = decider, load_decider
        self.supervisor, self.engine, self.proxy = supervisor, engine, proxy
        self.holds, self.state, self.prom, self.notifier = holds, state, metrics, notifier
        self.events = events
        self._closeables = closeables
        self.router = router
        self.stop = threading.Event()
        self._reload = threading.Event()  # `governor reload` (a control thread) asks
        self.signals = SignalInbox(loop.wake, on_again=supervisor.hurry)
        self._reloaded_t = float("-inf")
        self._waiters: list[Future[dict[str, Any]]] = []
        self._waiters_lock = threading.Lock()
        self.policy_name = config.policy
        self.policy_error: str | None = None
        self.reloads = 0  # done (failed ones included): coalesced SIGHUPs count once
        self.loop_errors = 0
        self.last_error: str | None = None  # the latest unexpected failure in the loop, for status
        self._ready_sent = False
        self._status_sent = ""
        self._status_sent_at: tuple[float, State | None] = (float("-inf"), None)  # when, and in which state
        self._log = structlog.get_logger("governor.daemon")
        self.control = ControlServer(config.control_socket, self, group=config.group)
        loop.before_tick.append(self._between_ticks)
        loop.max_wait_s = notifier.watchdog_interval_s  # a calm loop ticks slowly, but not past the watchdog
        loop.listeners.extend([state.on_tick, metrics.on_tick, self._after_tick])
        if router is not None and router.enabled:
            loop.listeners.append(router.on_tick)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or `stop` is set); then shut down in phases."""
        self.signals.install()
        try:
            self.control.start()
            self.proxy.start()
            if self.events is not None:
                self.events.start()
            self._log.info("governor running", control_socket=str(self.config.control_socket), policy=self.policy_name)
            self.supervisor.start()  # the first engine starts with the first decision's settings
            self.loop.run(self.stop, on_error=self._tick_failed)
        finally:
            self.shutdown()
            self.signals.ignore()
        return 0

    def request_stop(self) -> None:
        self.signals.stopping = True  # a SIGTERM from now on hurries the shutdown
        self.stop.set()
        self.supervisor.expect_exit()
        self.loop.wake.set()

    def request_reload(self) -> None:
        self._reload.set()
        self.loop.wake.set()

    def shutdown(self) -> None:
        """Stop accepting -> let the running answer finish (bounded) -> stop the engine -> restore."""
        log = self._log
        self.notifier.stopping("stopping: draining the running answer")
        log.info("stopping", phase="stop accepting")
        self.control.stop_accepting()
        self.proxy.stop_accepting()
        if self.events is not None:
            self.events.stop()
        # The engine drains itself on SIGTERM: it stops accepting, lets the running answer finish for
        # drain_timeout_s, then stops it at a token boundary; SIGKILL only if it overruns by stop_timeout_s.
        cfg = self.config
        log.info("stopping", phase="drain and stop the engine", drain_s=cfg.drain_timeout_s)
        self.supervisor.stop(cfg.drain_timeout_s + cfg.stop_timeout_s)
        self.proxy.close(cfg.stop_timeout_s)  # the running answers have ended with the engine (or got an error event)
        log.info("stopping", phase="restore")
        self.control.close()
        self.state.close_recorders()
        for actuator in reversed(self.loop.actuators):  # what each found before its first write (CPU limits)
            actuator.restore()
        for closeable in self._closeables:
            closeable.close()
        self.prom.close()
        if self.config.metrics_textfile is not None:
            with contextlib.suppress(FileNotFoundError):
                self.config.metrics_textfile.unlink()  # stale figures would read as a live daemon
        log.info("stopped")

    # -- between and after ticks (the loop's thread) ------------------------------------------------------------
    def _tick_failed(self, exc: Exception) -> float:
        """A bug or an input nobody foresaw: log it with its traceback, say so in status, and tick again."""
        self.loop_errors += 1
        self.last_error = f"tick failed: {type(exc).__name__}: {exc}"[:400]
        self._log.error("tick failed; carrying on", error=self.last_error, exc_info=exc)
        if self._ready_sent:
            self.notifier.watchdog(self.clock.now())  # the loop is not stuck: it runs and reports
        return ERROR_PAUSE_S

    def _between_ticks(self) -> None:
        if self.signals.take_stop():
            self.request_stop()
        if self.stop.is_set():
            return
        if self.signals.pending(signal.SIGHUP):
            due = self._reloaded_t + RELOAD_SPACING_S
            if self.clock.now() < due:
                self.loop.wake_at = due  # coalesced with those that follow it within the gap
            elif self.signals.take(signal.SIGHUP):
                self._reload.set()
        if not self._reload.is_set():
            return
        self._reload.clear()
        self._reloaded_t = self.clock.now()
        self.reloads += 1
        self.notifier.reloading()
        result: dict[str, Any]
        try:
            self.decider.inner = self._load_decider(self.config.policy)
        except Exception as exc:  # GovernorError is the expected kind; anything else is a bug, never a dead daemon
            expected = isinstance(exc, GovernorError)
            self.policy_error = str(exc) if expected else f"{type(exc).__name__}: {exc}"[:400]
            self._log.error(
                "reload failed; keeping the last good policy",
                error=self.policy_error,
                policy=self.policy_name,
                exc_info=None if expected else exc,
            )
            result = {"ok": False, "error": f"reload failed, kept the last good policy: {self.policy_error}"}
        else:
            self.policy_error = None
            self.supervisor.reset()
            self._log.info("policy reloaded", policy=self.policy_name)
            result = {"ok": True, "policy": self.policy_name}
        self.notifier.reloaded(self._status_line())
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.set_result(result)

    def _status_line(self) -> str:
        decision = self.loop.last
        if decision is None:
            return "starting"
        state = decision.state.value
        line = decision.reason if decision.reason.startswith(state) else f"{state}: {decision.reason}"
        if self.policy_error:
            line += f" [reload failed: {self.policy_error}]"
        return line[:400]

    def _after_tick(self, t: float, _s: Snapshot, _o: EngineObservation | None, decision: Decision) -> None:
        if self._ready_sent:  # systemd arms the watchdog once start-up is complete (READY=1): no pings before
            self.notifier.watchdog(t)
        st = self.supervisor.status
        if not self._ready_sent and (self.supervisor.ready or st.critical is not None or st.waiting is not None):
            # Ready once sensors gave a sample and the engine answers (or supervision gave up, or waits for memory:
            # say so, not crash).
            line = self._status_line()
            self.notifier.ready(line)
            self._ready_sent, self._status_sent, self._status_sent_at = True, line, (t, decision.state)
            self._log.info("ready", status=line)
        elif self.notifier.enabled and (
            decision.state != self._status_sent_at[1] or t - self._status_sent_at[0] >= STATUS_EVERY_S
        ):  # the line (the decision's reason) is built only when it may be sent
            line = self._status_line()
            if line != self._status_sent:
                self.notifier.status(line)
            self._status_sent, self._status_sent_at = line, (t, decision.state)

    # -- the control API (server threads) -----------------------------------------------------------------------
    def now(self) -> float:
        return self.clock.now()

    def status(self) -> dict[str, Any]:
        view = self.state.view()
        now = self.clock.now()
        sup = self.supervisor.status
        view.update(
            pid=os.getpid(),
            policy={"name": self.policy_name, "error": self.policy_error, "reloads": self.reloads},
            errors={"loop": self.loop_errors, "last": self.last_error, "control": self.control.errors},
            supervisor={k: v for k, v in asdict(sup).items() if k not in ("cap", "retry_at")}
            | {
                "cap": sup.cap.model_dump() if sup.cap else None,
                "retry_in_s": None if sup.retry_at is None else round(max(0.0, sup.retry_at - now), 1),
            },
            holds=[
                {
                    "id": cookie,
                    **hold.model_dump(mode="json", exclude={"expires_t"}),
                    "expires_in_s": None if hold.expires_t is None else round(hold.expires_t - now, 1),
                }
                for cookie, hold in self.holds.all().items()
            ],
            actuators={actuator.name: actuator.status() for actuator in self.loop.actuators},
        )
        if self.router is not None:
            view["routing"] = self.router.status()
        if (textfile := self.prom.textfile_status()) is not None:
            view["metrics_textfile"] = textfile
        return view

    def why(self, n: int) -> list[dict[str, Any]]:
        return self.state.recent(max(1, n))

    def routes(self, n: int) -> list[dict[str, Any]]:
        return [] if self.router is None else self.router.recent(max(1, n))

    def reload(self) -> dict[str, Any]:
        waiter: Future[dict[str, Any]] = Future()
        with self._waiters_lock:
            self._waiters.append(waiter)
        self.request_reload()
        try:
            return waiter.result(RELOAD_WAIT_S)
        except TimeoutError:
            return {"ok": False, "error": f"the loop did not reload within {RELOAD_WAIT_S:g} s"}

    def metrics(self) -> str:
        return self.prom.text()

    def add_hold(self, hold: Hold) -> int:
        tiers = [t.name for t in self.supervisor.ladder.tiers]
        if hold.max_tier is not None and hold.max_tier not in tiers:  # it would hold nothing, silently
            raise GovernorError(f"max_tier: no tier {hold.max_tier!r} in the ladder ({', '.join(tiers)})")
        cookie = self.holds.add(hold)
        self._log.info("hold taken", hold=cookie, **hold.model_dump(mode="json", exclude_none=True))
        return cookie

    def release_hold(self, cookie: int) -> None:
        self.holds.release(cookie)

    def subscribe(self) -> queue.Queue[TraceRecord | None]:
        return self.state.subscribe()

    def unsubscribe(self, q: queue.Queue[TraceRecord | None]) -> None:
        self.state.unsubscribe(q)
