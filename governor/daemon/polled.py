"""What the daemon needs from an engine that tells it nothing by itself (llama.cpp's llama-server, an external server):
its status polled as a pushing engine's is read, the public socket's word when a chat comes in, and which process
listens on a socket."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from governor.daemon.restarts import Availability
from governor.engine.client import EngineError, EngineStatus, EngineUnavailable
from sensors.snapshot import EngineObservation

if TYPE_CHECKING:
    from governor.daemon.proxy import EngineGate


def peer_pid(path: Path) -> int | None:
    """The pid of the process listening on a Unix socket (SO_PEERCRED): which server answers there."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        sock.connect(str(path))
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[0])
    return None


class StatusPoll:
    """The status of an engine that pushes nothing, as the watch reads a pushing one (`events`): `read()` now, then at
    every poll: each `busy_s` while it answers, else each heartbeat, or at once after `kick()` (a chat came in). A poll
    that brings nothing new yields the last object again (the watch's heartbeat)."""

    def __init__(self, read: Callable[[], EngineStatus], where: Path, busy_s: float | None = None) -> None:
        self.read, self.where, self.busy_s = read, where, busy_s
        self._kick = threading.Event()
        self._closed = threading.Event()

    def events(self, heartbeat_s: float | None) -> Generator[EngineStatus, None, None]:
        idle_s = heartbeat_s if heartbeat_s is not None else 5.0
        busy_s = idle_s if self.busy_s is None else min(self.busy_s, idle_s)
        last: EngineStatus | None = None
        self._closed.clear()
        while not self._closed.is_set():
            status = self.read()
            if status != last:
                last = status
            yield last
            self._kick.wait(busy_s if last.busy else idle_s)
            self._kick.clear()
        raise EngineUnavailable(self.where, "the status stream ended")

    def kick(self) -> None:
        self._kick.set()

    def interrupt(self) -> None:
        self._closed.set()
        self._kick.set()


class NoticingGate:
    """The supervisor as the public socket's gate (governor.daemon.proxy.EngineGate), telling an engine driver that
    learns nothing by itself when a chat comes in (`on_chat(True)`) and ends (`on_chat(False)`): an idle llama-server
    is polled only at the heartbeat, and an external server says nothing of what it does."""

    def __init__(self, supervisor: EngineGate, on_chat: Callable[[bool], None]) -> None:
        self.supervisor, self.on_chat = supervisor, on_chat

    def availability(self) -> Availability:
        return self.supervisor.availability()

    def request_started(self, *, chat: bool) -> int:
        if chat:
            self.on_chat(True)
        return self.supervisor.request_started(chat=chat)

    def request_ended(self, start: int, *, answered: bool) -> None:
        """(The public socket ends only chats, answered or not: governor.daemon.proxy.)"""
        self.on_chat(False)
        self.supervisor.request_ended(start, answered=answered)

    def exit_of(self, start: int) -> str | None:
        return self.supervisor.exit_of(start)


class PolledDriver:
    """What a driver of an engine that pushes nothing (llama-server, an external server) shares: its status stream is
    `poll`'s, and an observation is its status read now."""

    poll: StatusPoll

    def status(self) -> EngineStatus:
        raise NotImplementedError

    def events(self, *, heartbeat_s: float | None = None) -> Generator[EngineStatus, None, None]:
        """Its status at every heartbeat, and at once when a chat comes in or ends."""
        return self.poll.events(heartbeat_s)

    def interrupt_streams(self) -> None:
        self.poll.interrupt()

    def observe(self) -> EngineObservation | None:
        try:
            return self.status().observation()
        except EngineError as exc:
            structlog.get_logger("governor.engine").warning("engine status unavailable", error=str(exc))
            return None
