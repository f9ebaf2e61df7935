"""The public chat socket itself: bound at once, served by uvicorn (its httptools protocol, bounded by connguard's
Guard) on a thread and event loop of its own, with `governor.daemon.proxy.ProxyApp` as the application."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from governor import unixsock
from governor.daemon.connguard import Guard
from governor.daemon.pacing import Pace
from governor.daemon.proxy import EngineGate, ProxyApp, ProxyError
from governor.daemon.routing import Router


def fast_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (optional: `pip install inference-governor[fast]`; no wheels for
    Termux), else asyncio's own (None): about 10-25 % less CPU per relayed token (docs/benchmarks.md).
    GOVERNOR_PROXY_LOOP=asyncio chooses asyncio's even when uvloop is there."""
    if os.environ.get("GOVERNOR_PROXY_LOOP") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class ProxyServer:
    """The public socket, bound at once (so a bad path is a one-line error at start), served on its own thread."""

    def __init__(
        self,
        path: Path,
        upstream: Path | tuple[str, int],
        gate: EngineGate,
        *,
        hold_s: float,
        drain_s: int,
        group: str | None = None,
        router: Router | None = None,
        pace: Pace | None = None,
        rewrite: Callable[[str, bytes], bytes] | None = None,
    ) -> None:
        self.path = path
        if len(os.fsencode(path)) >= 108 or (isinstance(upstream, Path) and len(os.fsencode(upstream)) >= 108):
            raise ProxyError(f"{path}: a Unix socket path must be shorter than 108 bytes (with its -child twin)")
        try:
            gid = grp.getgrnam(group).gr_gid if group else -1
        except KeyError:
            raise ProxyError(f"engine socket group {group!r} does not exist") from None
        self._sock = unixsock.bind_unix(
            path, 0o660 if group else 0o600, lambda reason: ProxyError(f"engine socket {path}: {reason}")
        )
        if group:
            os.chown(path, -1, gid)
        self._sock.listen(128)  # connections wait in the backlog until uvicorn runs: never refused once it exists
        self._inode = os.stat(path).st_ino
        self.app = ProxyApp(upstream, gate, hold_s=hold_s, router=router, pace=pace, rewrite=rewrite)
        self.guard = Guard()
        config = uvicorn.Config(
            self.app,
            http=self.guard.protocol(),  # connections capped, per user too, and a silent one closed (connguard.py)
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            server_header=False,  # the engine's own headers pass through
            date_header=False,
            timeout_graceful_shutdown=drain_s,  # then uvicorn cancels what still runs
        )
        self._server = QuietServer(config)
        self._thread = threading.Thread(target=self._serve, name="engine-proxy", daemon=True)

    def _serve(self) -> None:
        with asyncio.Runner(loop_factory=fast_loop()) as runner:
            runner.run(self._server.serve(sockets=[self._sock]))

    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        """uvicorn closes the listener, then lets running answers finish (up to drain_s) while the engine drains."""
        self._server.stop()
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:
                self.path.unlink()

    def close(self, timeout_s: float) -> None:
        self.stop_accepting()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()


class QuietServer(uvicorn.Server):
    """uvicorn's main loop wakes every 0.1 s to look at `should_exit`: ten wake-ups a second of an idle daemon
    (issue 16). This one sleeps until `stop()` (any thread) wakes it."""

    _loop: asyncio.AbstractEventLoop | None = None
    _exit: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._exit = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if await self.on_tick(0):  # the default headers, once; True when stop() came first
            return
        await self._exit.wait()

    def stop(self) -> None:
        self.should_exit = True
        loop, event = self._loop, self._exit
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(event.set)
