"""The built-in engine's driver (governor.daemon.driver): `governor engine`, llama-cpp-python in a child process that
serves the OpenAI API and the engine's control API on the daemon's private socket.

It changes threads and the rate cap between two tokens and every other setting by rebuilding its context in place,
continuing the answer (the knobs' `live` flags, policies.decision): never a restart.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator
from pathlib import Path

from governor.daemon.driver import Capabilities
from governor.engine.client import EngineClient, EngineStatus
from policies.decision import KNOBS, EngineConfig
from policies.schema import EngineOptions
from sensors.snapshot import EngineObservation

CAPABILITIES = Capabilities.of(
    "llama-cpp-python",
    live=[name for name, knob in KNOBS.items() if knob.live],
    reload=[name for name, knob in KNOBS.items() if not knob.live],
)
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
        "--exit-with-parent",
    ]
    if options.stream_interval_ms is not None:
        argv += ["--stream-interval-ms", f"{options.stream_interval_ms:g}"]
    return argv if extra_buffers is None else [*argv, "--extra-buffers", extra_buffers]


class LlamaCppPython:
    """The driver: the child's command line, and its client for everything else."""

    capabilities = CAPABILITIES

    def __init__(
        self,
        ladder: Path,
        socket_path: Path,
        *,
        drain_s: float = 10.0,
        options: Callable[[], EngineOptions] = EngineOptions,
        timeout_s: float = 2.0,
    ) -> None:
        """`options()`: the policy's `[engine]` table in force when the engine (re)starts; `timeout_s`: how long the
        daemon waits for an answer (a hung engine must not stall the loop for long)."""
        self.ladder, self.socket_path, self.drain_s, self._options = ladder, socket_path, drain_s, options
        self.client = EngineClient(socket_path, timeout_s=timeout_s)

    def command(self, config: EngineConfig, extra_buffers: str | None) -> list[str]:
        return engine_command(
            self.ladder,
            self.socket_path,
            config,
            drain_s=self.drain_s,
            options=self._options(),
            extra_buffers=extra_buffers,
        )

    def wait_ready(self, timeout_s: float) -> EngineStatus:
        return self.client.wait_ready(timeout_s)

    def events(self, *, heartbeat_s: float | None = None) -> Generator[EngineStatus, None, None]:
        return self.client.events(heartbeat_s=heartbeat_s)

    def interrupt_streams(self) -> None:
        self.client.interrupt_streams()

    def observe(self) -> EngineObservation | None:
        return self.client.observe()

    def apply(self, config: EngineConfig) -> None:
        self.client.apply(config)

    def pause(self, reason: str | None) -> None:
        self.client.pause(reason)

    def prepare_restart(self, config: EngineConfig) -> None:
        """Never called: it changes every setting in place (its capabilities have nothing that needs a restart)."""

    def close(self) -> None:
        self.client.close()
