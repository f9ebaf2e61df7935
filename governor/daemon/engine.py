"""The engine as the loop sees it: the supervised child process plus its client, behind `EngineControl`.

`apply()` never blocks the loop: a model or context change makes the engine reload at a token boundary, which can
take seconds, so configs go to one applier thread that always posts the latest one (older ones are skipped).
`observe()` does no I/O when a watch is given: the engine pushes its status on change (governor/daemon/watch.py).

When no tier fits in memory (the decision's `engine_wait`), the same thread tells the running engine to pause: it
unloads its model at the next token boundary and the answer waits, its client's stream open; when the wait ends, to
resume: it loads again and continues the answer. (The supervisor stops an engine that has no answer to keep.)
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Protocol

import structlog
from pydantic import BaseModel

from govbase.errors import GovernorError
from governor.daemon.supervisor import EngineSupervisor
from policies.decision import Decision, EngineConfig
from policies.schema import EngineOptions
from sensors.psutil_backend import ProcessStats
from sensors.snapshot import EngineObservation, Snapshot


class EngineLink(Protocol):
    """The engine client, as the daemon uses it (governor.engine.client.EngineClient)."""

    def observe(self) -> EngineObservation | None: ...

    def apply(self, config: EngineConfig) -> None: ...

    def pause(self, reason: str | None) -> None: ...


DEFAULT_OPTIONS = EngineOptions()


def engine_command(
    ladder: Path,
    socket_path: Path,
    config: EngineConfig,
    *,
    drain_s: float = 10.0,
    options: EngineOptions = DEFAULT_OPTIONS,
    extra_buffers: str | None = None,
) -> list[str]:
    """The child's argv: the engine process of the engine issue, with all of this decision's settings, serving on the
    daemon's private socket (0600: only the daemon's proxy and client talk to it). On SIGTERM it stops accepting
    and lets the running answer finish for `drain_s`, then stops it at a token boundary. `options` are the policy's
    `[engine]` table (idle unload, stream interval). `extra_buffers` ("off" after a crash) overrides the engine's own
    choice of llama.cpp extra buffer types."""
    argv = [
        sys.executable,
        "-m",
        "governor.engine",  # the lean entry point: not every subcommand's modules (governor.engine.__main__)
        "--log-json",
        "engine",
        "--models",
        str(ladder),
        "--tier",
        config.model,
        *config.flags(),
        "--socket",
        str(socket_path),
        "--drain-s",
        f"{drain_s:g}",
        "--keep-alive",
        f"{options.keep_alive_s:g}",
    ]
    if options.stream_interval_ms is not None:
        argv += ["--stream-interval-ms", f"{options.stream_interval_ms:g}"]
    return argv if extra_buffers is None else [*argv, "--extra-buffers", extra_buffers]


class Watch(Protocol):
    """governor.daemon.watch.EngineWatch: the engine's last pushed status, or None while not connected."""

    @property
    def latest(self) -> EngineObservation | None: ...

    def close(self) -> None: ...


class SupervisedEngine:
    def __init__(self, link: EngineLink, supervisor: EngineSupervisor, watch: Watch | None = None) -> None:
        self.link = link
        self.supervisor = supervisor
        self.watch = watch
        self._cond = threading.Condition()
        self._next: EngineConfig | None = None
        self._pause: str | None = None  # the decision's engine_wait: the engine must hold its model unloaded
        self._paused: tuple[int, str | None] = (0, None)  # (engine start, reason) the engine was told last
        self._in_flight = False
        self._stopping = False
        self._agreed: tuple[object, EngineConfig | None] = (None, None)  # the status and config last found to agree
        self._stats: ProcessStats | None = None
        self._thread = threading.Thread(target=self._apply_latest, name="engine-applier", daemon=True)
        self._thread.start()
        self._log = structlog.get_logger("governor.engine")

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

    def apply(self, config: EngineConfig) -> None:
        self.supervisor.want(config)  # the first decision starts the engine with its settings
        with self._cond:
            self._next = config
            self._cond.notify()

    def on_tick(self, _t: float, _s: Snapshot, _o: EngineObservation | None, decision: Decision) -> None:
        """A loop listener: pause the engine while the decision says nothing fits in memory, resume it after."""
        with self._cond:
            if decision.engine_wait != self._pause:
                self._pause = decision.engine_wait
                self._cond.notify()

    def _pause_due(self) -> bool:
        """The engine process has not been told the pause in force (lock held). A new process starts unpaused (and
        the supervisor starts none while the wait lasts)."""
        told_start, told = self._paused
        return self._pause != (told if told_start == self.supervisor.status.starts else None)

    def _apply_latest(self) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._pause_due() and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                config, self._next = self._next, None
                pause, reason, start = self._pause_due(), self._pause, self.supervisor.status.starts
                self._paused = (start, reason)  # once: an engine not ready now is stopped, or starts unpaused
                self._in_flight = config is not None
            if pause and self.supervisor.ready:
                self._send_pause(reason)  # first: memory is what the device lacks now
            if config is None or not self.supervisor.ready:
                self._in_flight = False
                continue  # a (re)starting engine gets the latest desired config once it is ready
            try:
                self.link.apply(config)
            except (GovernorError, OSError) as exc:  # refused or unreachable: the next decision or restart retries
                self._log.warning("engine did not take the config", error=str(exc), **config.model_dump())
            finally:
                self._in_flight = False

    def _send_pause(self, reason: str | None) -> None:
        try:
            self.link.pause(reason)
        except (GovernorError, OSError) as exc:  # e.g. it is being stopped (a new one starts unpaused)
            self._log.warning("engine did not take the pause", error=str(exc), reason=reason)

    def correct_drift(self, running: BaseModel) -> None:
        """The engine runs other settings than the loop wants (someone posted to its /engine/config): log the drift
        and apply ours again. Not while a config is on its way to it (the engine may be half way there). An idle
        engine's heartbeat repeats its last status object: a status found to agree with ours is not compared again."""
        desired = self.supervisor.desired
        if self._agreed[0] is running and self._agreed[1] is desired:
            return
        with self._cond:
            if desired is None or self._in_flight or self._next is not None or self._stopping:
                return
            ours, fields = desired, running.model_dump()
            drift = {k: [fields.get(k), v] for k, v in ours.model_dump().items() if fields.get(k) != v}
            if not drift:
                self._agreed = (running, desired)
                return
            self._next = ours
            self._cond.notify()
        self._log.warning("engine config drifted (engine, ours); applying ours again", drift=drift)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(5.0)
        if self.watch is not None:
            self.watch.close()
