"""`governor dashboard`: a local web page with the live graphs and the decision log.

A process of its own (the daemon serves no TCP): one `watch` stream from the control socket, shared by every open
page through server-sent events, so a second browser tab costs the daemon nothing. The page and its charting
library (uPlot, MIT, in `static/`) come from this package: nothing is fetched from elsewhere, the device may be
offline.

Read-only by default. Holds and reload need the token printed at start (in the page's address after `#token=`, which
the browser never sends to a server; the page sends it in an Authorization header, so another site cannot make the
browser use it). Requests must name this server as their Host (a page on another site that rebinds its name to
127.0.0.1 is refused), and the page may not be framed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import selectors
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from govbase.errors import GovernorError
from governor.daemon.client import ControlClient
from governor.daemon.control import DAY_S, ControlError
from governor.views.feed import zone_of
from policies.decision import HoldAsk

STATIC = Path(__file__).with_name("static")
HISTORY = 900  # samples a new page gets: 15 min at one a second, 75 min of calm 5 s ticks
KEEP_DECISIONS = 100
STATUS_LAG_S = 10.0  # a status may be this much older than a hold taken meanwhile (a tick, the watch's queue)
MAX_PAGES = 16  # pages attached at once; more get 503 (each holds a queue and a connection)
PAGE_QUEUE = 64  # events a page may lag behind before it is dropped (its browser reconnects and starts afresh)
MAX_HOLDS = 8
KEEPALIVE_S = 15.0
RECONNECT_S = 2.0
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class DashboardError(GovernorError):
    pass


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise DashboardError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8765 (PORT 0: any free port)")
    return host.strip("[]"), int(port)


def sample(line: dict[str, Any]) -> dict[str, Any]:
    """What the graphs draw from one stream line (the page gets the full status only for the latest)."""
    status = line.get("status") or {}
    readings = status.get("readings") or {}
    zones = {}
    for reading in readings.get("temperatures") or []:
        zone = zone_of(reading)
        if zone.trip_c is not None:
            zones[zone.source] = {"label": zone.label, "temp_c": reading.get("temp_c"), "trip_c": zone.trip_c}
    basis = status.get("basis") or {}
    engine = status.get("engine") or {}
    config = status.get("config") or {}
    freq = (status.get("actuators") or {}).get("cpufreq") or {}
    return {
        "wall": line.get("wall"),
        "state": status.get("state"),
        "zones": zones,
        "binding": basis.get("zone"),
        "forecast_c": basis.get("forecast_c"),
        "tokens_per_s": engine.get("tokens_per_s"),
        "max_tokens_per_s": config.get("max_tokens_per_s"),
        "threads": config.get("threads"),
        "freq_ratio": (readings.get("cpu") or {}).get("freq_ratio"),
        "cap_ratio": freq.get("ratio"),
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class Relay:
    """The daemon's watch stream, read on a thread and handed to every page's queue on the server's event loop."""

    def __init__(self, client: ControlClient, mine: Callable[[], list[int]]) -> None:
        self.client = client
        self.mine = mine  # the hold ids this dashboard holds, marked on the page
        self.samples: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=KEEP_DECISIONS)
        self.status: dict[str, Any] = {}
        self.down: str | None = "connecting to the governor"
        self.on_status: list[Callable[[dict[str, Any]], None]] = []
        self._pages: set[asyncio.Queue[str | None]] = set()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._watch: Any = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        threading.Thread(target=self._run, name="relay", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError, AttributeError):
            self._watch.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self.client.watch() as watch, selectors.DefaultSelector() as sel:
                    self._watch = watch
                    self._take(watch.first, first=True)
                    sel.register(watch, selectors.EVENT_READ)
                    while not self._stop.is_set():
                        for line in watch.lines():
                            self._take(line, first=False)
                        sel.select()
            except (ControlError, OSError, ValueError) as exc:
                if self._stop.is_set():
                    return
                with self._lock:
                    self.down = str(exc)
                self._publish(_event("down", {"error": self.down}))
            self._stop.wait(RECONNECT_S)

    def _take(self, line: dict[str, Any], *, first: bool) -> None:
        point = sample(line)
        status = line.get("status") or {}
        with self._lock:
            self.down = None
            if first:
                self.decisions.clear()
            self.decisions.extend(line.get("decisions") or [])
            self.samples.append(point)
            self.status = status
        for hook in self.on_status:
            hook(status)
        tick = {"sample": point, "status": status, "decisions": line.get("decisions") or [], "mine": self.mine()}
        self._publish(_event("tick" if not first else "up", tick | {"replace": first}))

    def _publish(self, text: str) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
                loop.call_soon_threadsafe(self._fan_out, text)

    def _fan_out(self, text: str) -> None:
        for q in list(self._pages):
            try:
                q.put_nowait(text)
            except asyncio.QueueFull:  # a page that stopped reading: end its stream, its browser reconnects
                self._pages.discard(q)
                with contextlib.suppress(asyncio.QueueFull):
                    q.get_nowait()
                    q.put_nowait(None)

    def hello(self, control: bool) -> str:
        with self._lock:
            data = {
                "samples": list(self.samples),
                "decisions": list(self.decisions),
                "status": self.status,
                "down": self.down,
                "control": control,
                "mine": self.mine(),
            }
        return _event("hello", data)

    async def page(self, control: bool) -> AsyncIterator[str]:
        if len(self._pages) >= MAX_PAGES:
            raise DashboardError(f"{MAX_PAGES} pages are open already")
        q: asyncio.Queue[str | None] = asyncio.Queue(maxsize=PAGE_QUEUE)
        self._pages.add(q)
        try:
            yield self.hello(control)
            while True:
                try:
                    text = await asyncio.wait_for(q.get(), KEEPALIVE_S)
                except TimeoutError:
                    text = ": keep-alive\n\n"
                if text is None:
                    return
                yield text
        finally:
            self._pages.discard(q)


class _HoldRequest(HoldAsk):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    ttl_s: float = Field(default=3600.0, gt=0, le=DAY_S)


class Holds:
    """Holds this dashboard keeps for its pages: each one an open control connection, released when closed."""

    def __init__(self, client: ControlClient, *, status_lag_s: float = STATUS_LAG_S) -> None:
        self.client, self.status_lag_s = client, status_lag_s
        self._held: dict[int, tuple[socket.socket, float]] = {}  # its connection, when it was taken (monotonic)
        self._lock = threading.Lock()

    def ids(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def take(self, ask: _HoldRequest) -> dict[str, Any]:
        with self._lock:  # held across the (local, quick) exchange: two pages cannot both take the last place
            if len(self._held) >= MAX_HOLDS:
                raise DashboardError(f"this dashboard holds {MAX_HOLDS} already; release one first")
            answer, sock = self.client.take_hold(**ask.model_dump(exclude_none=True))
            self._held[int(answer["hold"])] = (sock, time.monotonic())
        return answer

    def release(self, hold_id: int) -> bool:
        with self._lock:
            held = self._held.pop(hold_id, None)
        if held is None:
            return False
        held[0].close()
        return True

    def prune(self, status: dict[str, Any]) -> None:
        """Forget holds the daemon ended (TTL, restart): their ids are no longer in its status. Not one taken in the
        last `status_lag_s`: a status built a moment before the hold was added can arrive after it (and releasing the
        hold then ended it at once, the page having just said "holding")."""
        alive = {h.get("id") for h in status.get("holds") or []}
        now = time.monotonic()
        with self._lock:
            gone = [i for i, (_, taken) in self._held.items() if i not in alive and now - taken > self.status_lag_s]
        for hold_id in gone:
            self.release(hold_id)

    def close(self) -> None:
        for hold_id in self.ids():
            self.release(hold_id)


class Dashboard:
    """The web side: the page, its event stream, and (with the token) holds and reload."""

    def __init__(self, client: ControlClient, *, token: str | None, hosts: list[str]) -> None:
        self.client = client
        self.token = token  # None: read-only, no holds or reload at all
        self.holds = Holds(client)
        self.relay = Relay(client, self.holds.ids)
        self.relay.on_status.append(self.holds.prune)
        routes = [
            Route("/", self.index),
            Route("/events", self.events),
            Route("/api/reload", self.reload, methods=["POST"]),
            Route("/api/hold", self.hold, methods=["POST"]),
            Route("/api/hold/{hold_id:int}", self.release, methods=["DELETE"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
        middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=hosts)]
        self.app = Starlette(routes=routes, middleware=middleware, lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.relay.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            self.relay.stop()
            self.holds.close()

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=HEADERS)

    async def events(self, request: Request) -> Response:
        stream = self.relay.page(self.token is not None)
        try:
            first = await anext(stream)
        except DashboardError as exc:
            return _error(str(exc), 503)

        async def body() -> AsyncIterator[str]:
            yield first
            async for text in stream:
                yield text

        return StreamingResponse(body(), media_type="text/event-stream", headers=HEADERS)

    async def reload(self, request: Request) -> Response:
        return await self._act(request, lambda: self.client.request("reload"))

    async def hold(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._refuse()
        try:
            ask = _HoldRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            return _error(f"bad hold: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}", 400)
        if not HoldAsk.model_validate(ask.model_dump(exclude={"ttl_s"})).asks():
            return _error("a hold needs a state or a limit", 400)
        return await self._act(request, lambda: self.holds.take(ask))

    async def release(self, request: Request) -> Response:
        hold_id = int(request.path_params["hold_id"])

        def release_it() -> dict[str, Any]:
            if not self.holds.release(hold_id):
                raise DashboardError(f"hold {hold_id} is not one this dashboard holds")
            return {"ok": True, "released": hold_id}

        return await self._act(request, release_it)

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return self.token is not None and secrets.compare_digest(given.encode(), self.token.encode())

    def _refuse(self) -> Response:
        return _error("this dashboard is read-only" if self.token is None else "holds and reload need its token", 403)

    async def _act(self, request: Request, action: Callable[[], dict[str, Any]]) -> Response:
        if not self._authorized(request):
            return self._refuse()
        try:
            answer = await asyncio.to_thread(action)
        except (ControlError, DashboardError) as exc:
            return _error(str(exc), 409)
        return JSONResponse(answer, headers=HEADERS)


def _error(text: str, status: int) -> Response:
    return JSONResponse({"ok": False, "error": text}, status_code=status, headers=HEADERS)


def _hosts(host: str, port: int) -> list[str]:
    if host in ("0.0.0.0", "::", ""):
        return ["*"]  # asked to be reachable from the network: any name it is reached by
    names = {host, f"{host}:{port}"}
    if host in ("127.0.0.1", "::1", "localhost"):
        names |= {"localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}", "[::1]", f"[::1]:{port}"}
    return sorted(names)


def serve(client: ControlClient, host: str, port: int, *, control: bool = True) -> int:
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DashboardError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(64)
    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(18) if control else None
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    url = f"http://{shown}:{port}/"
    print(f"governor dashboard: {url} (read-only)", flush=True)
    if token is not None:
        print(f"holds and reload: {url}#token={token} (keep it to yourself: it acts on the daemon)", flush=True)
    if _hosts(host, port) == ["*"]:
        print("governor dashboard: reachable beyond this machine; whoever reaches it sees the status", file=sys.stderr)
    app = Dashboard(client, token=token, hosts=_hosts(host, port)).app
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
