"""The engine driver: everything the daemon needs from the thing that serves tokens, behind one interface.

The daemon supervises a process (governor.daemon.supervisor), converges it to the decision's settings
(governor.daemon.desired), watches its status (governor.daemon.watch) and proxies chats to its socket; a driver says,
for one kind of engine, how each of these is done:

- `capabilities`: which settings it changes live (between two tokens), which by rebuilding its context in place (the
  conversation kept), and which only by a restart of its process (the supervisor restarts it with the new settings);
  and whether the daemon starts it at all (`managed`: an external server is governed, never started).
- `command(config, extra_buffers)`: the argv that starts it with these settings (managed engines).
- `wait_ready`, `events`, `interrupt_streams`, `observe`: how it says it answers and what it is doing
  (`EngineStatus`: its settings plus what it is doing; the status stream is also the liveness signal).
- `apply(config)`: the one idempotent message, the whole config (sent only by governor.daemon.desired);
  `pause(reason)`: hold the model unloaded while nothing fits in memory; `prepare_restart(config)`: the engine is
  about to be restarted to run `config`, keep what can be kept (llama-server saves the conversation's KV cache).

The llama-cpp-python child (`governor engine`, governor.daemon.llamacpp) is the first driver. llama.cpp's own
`llama-server` fits as a managed engine whose settings need a restart (and whose rate cap is paced by the proxy);
an external OpenAI-compatible server as an unmanaged one whose capabilities are empty.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from governor.engine.client import EngineStatus
from policies.decision import KNOBS, EngineConfig
from sensors.snapshot import EngineObservation

How = Literal["live", "reload", "restart"]


@dataclass(frozen=True)
class Capabilities:
    engine: str  # which engine: "llama-cpp-python", "llama-server", ...
    live: frozenset[str]  # settings changed between two tokens
    reload: frozenset[str]  # settings changed by rebuilding the context in the running process
    managed: bool = True  # the daemon starts and supervises the process

    @classmethod
    def of(cls, engine: str, *, live: Iterable[str], reload: Iterable[str], managed: bool = True) -> Capabilities:
        live, reload = frozenset(live), frozenset(reload)
        unknown = (live | reload) - set(KNOBS)
        if unknown:
            raise ValueError(f"{engine}: not engine settings: {sorted(unknown)}")
        return cls(engine, live, reload, managed)

    def how(self, old: EngineConfig, new: EngineConfig) -> How | None:
        """What going from `old` to `new` takes in this engine; None when nothing changes (or, for an engine the
        daemon does not start, nothing it can change: the rest is out of its hands)."""
        changed = {name for name in KNOBS if getattr(old, name) != getattr(new, name)}
        if not self.managed:
            changed &= self.live | self.reload
        if not changed:
            return None
        if changed <= self.live:
            return "live"
        return "reload" if changed <= self.live | self.reload else "restart"

    def as_dict(self) -> dict[str, Any]:
        rest = [name for name in KNOBS if name not in self.live | self.reload]
        return {
            "engine": self.engine,
            "managed": self.managed,
            "live": [name for name in KNOBS if name in self.live],
            "reload": [name for name in KNOBS if name in self.reload],
            "restart": rest if self.managed else [],
            "cannot": [] if self.managed else rest,  # an external engine's: the governor cannot change them
        }


class EngineDriver(Protocol):
    @property
    def capabilities(self) -> Capabilities: ...

    def command(self, config: EngineConfig, extra_buffers: str | None) -> list[str]: ...

    def wait_ready(self, timeout_s: float) -> EngineStatus: ...

    def events(self, *, heartbeat_s: float | None = None) -> Generator[EngineStatus, None, None]: ...

    def interrupt_streams(self) -> None: ...

    def observe(self) -> EngineObservation | None: ...

    def apply(self, config: EngineConfig) -> None: ...

    def pause(self, reason: str | None) -> None: ...

    def prepare_restart(self, config: EngineConfig) -> None: ...

    def close(self) -> None: ...
