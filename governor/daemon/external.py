"""Any local OpenAI-compatible server as an external engine (`governor run --engine external --engine-url URL`): the
governor does not start it, it governs it with what does not depend on the engine, and says what it cannot control.

- **Ready while it answers** (`GET /v1/models`, probed every probe interval): the public socket holds requests while it
  does not, then answers 503 with the reason, as for a restarting engine (`ExternalSupervisor`).
- **Threads** by CPU affinity: every thread of the server's process (found by the socket it listens on: SO_PEERCRED
  for a Unix socket, the listening TCP port's owner otherwise) pinned to `threads` CPUs, where the governor may
  (the same user, or root); put back as found at exit. On Ollama's native API (`/api/chat`, `/api/generate`) also
  `options.num_thread` in each request.
- **n_ctx** on Ollama's native API: `options.num_ctx` in each request (no more than the client asked for), and
  `keep_alive` from the policy's `[engine] keep_alive_s` where the client set none. Ollama's OpenAI-compatible
  `/v1/chat/completions` reads neither (its ChatCompletionRequest has no `options`), so those are left alone.
- **The model** by name, where `[external] models` maps the ladder's tiers to the server's model names: a request
  for one of those names (or for none) gets the name of the tier the decision chose.
- **The rate cap** paced on the public socket (governor.daemon.pacing), the process held while ahead where the
  governor may signal it; **clock and power caps** as for every engine (the cpufreq actuator).
- **Cannot**: the KV cache type and batch size, and the context on an OpenAI-compatible API (the server's own
  flags); unloading its model for memory (new requests are held instead).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import structlog
from pydantic import BaseModel

from govbase.errors import GovernorError
from governor.daemon.driver import Capabilities
from governor.daemon.pacing import Pace
from governor.daemon.polled import PolledDriver, StatusPoll, peer_pid
from governor.daemon.restarts import Availability
from governor.daemon.supervisor import EngineSupervisor
from governor.engine.client import EngineError, EngineStatus, EngineUnavailable, _UnixTransport
from policies.decision import EngineConfig
from policies.schema import EngineOptions

OLLAMA_PATHS = frozenset({"/api/chat", "/api/generate"})  # Ollama's native API: per-request options
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
Address = Path | tuple[str, int]


class ExternalError(GovernorError):
    pass


def parse_url(url: str) -> Address:
    """`http://HOST:PORT` (a local TCP server) or `unix:/path/to.sock`; the API paths go to it unchanged."""
    if url.startswith("unix:"):
        return Path(url.removeprefix("unix:"))
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path.strip("/"):
        raise ExternalError(f"--engine-url {url!r}: http://HOST:PORT (no path) or unix:/path/to.sock")
    return parts.hostname, parts.port or 80


def listening_pid(address: Address) -> int | None:
    """The process that listens there (None when it cannot be seen: another user's, without root)."""
    if isinstance(address, Path):
        return peer_pid(address)
    host, port = address
    with contextlib.suppress(psutil.Error, OSError):
        ips = sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
        listening = {
            conn.laddr.ip: int(conn.pid)
            for conn in psutil.net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid
        }
        # The one the kernel hands our connection to: bound to the address itself before one bound to all (another
        # user's server on the same port at another address is not the engine: it is never pinned).
        for ip in (*ips, "0.0.0.0", "::"):
            if ip in listening:
                return listening[ip]
    return None


class Affinity:
    """Every thread of one process pinned to the first N of the CPUs it had; what it had put back on `restore`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.found = sorted(os.sched_getaffinity(pid))
        self.error: str | None = None

    def pin(self, n: int) -> None:
        self._set(self.found[: max(1, n)])

    def restore(self) -> None:
        with contextlib.suppress(OSError):
            self._set(self.found)

    def _set(self, cpus: list[int]) -> None:
        try:
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(tid), cpus)
            self.error = None
        except OSError as exc:  # EPERM: another user's process
            self.error = f"cannot set the CPU affinity of pid {self.pid}: {exc.strerror}"
            raise


class External(PolledDriver):
    """The driver (governor.daemon.driver.EngineDriver) of a server the governor does not start."""

    def __init__(
        self,
        url: str,
        *,
        models: Mapping[str, str] | None = None,
        options: Callable[[], EngineOptions] = EngineOptions,
        timeout_s: float = 2.0,
    ) -> None:
        self.url, self.address = url, parse_url(url)
        self.models = dict(models or {})  # ladder tier -> the server's model name
        self._options = options
        self.timeout_s = timeout_s
        transport = _UnixTransport(self.address) if isinstance(self.address, Path) else None
        base = "http://external" if isinstance(self.address, Path) else url.rstrip("/")
        self._http = httpx.Client(transport=transport, base_url=base, timeout=timeout_s)
        self.pid: int | None = None
        self.ollama = False  # it answers Ollama's native API too (GET /api/version)
        self.affinity: Affinity | None = None
        self._pinned: int | None = None  # the threads its process is pinned to now
        self.pace = Pace(lambda: self.pid)
        self.running: EngineConfig | None = None
        self.in_flight = 0  # chat requests through the public socket now (the server says nothing of it)
        self._lock = threading.Lock()
        self.poll = StatusPoll(self._answers_now, Path(url))
        self._log = structlog.get_logger("governor.external")

    @property
    def capabilities(self) -> Capabilities:
        live = {"max_tokens_per_s"}
        if self.ollama or self.affinity is not None:
            live.add("threads")
        if self.ollama:
            live.add("n_ctx")
        if self.models:
            live.add("model")
        name = "external (Ollama)" if self.ollama else "external"
        return Capabilities.of(name, live=live, reload=[], managed=False)

    # -- the server ---------------------------------------------------------------------------------------------------
    def command(self, config: EngineConfig, extra_buffers: str | None) -> list[str]:
        raise ExternalError(f"the engine at {self.url} is external: the governor does not start it")

    def wait_ready(self, timeout_s: float) -> EngineStatus:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.request("GET", "/v1/models")
                break
            except EngineError as exc:
                if time.monotonic() > deadline:
                    raise EngineUnavailable(Path(self.url), f"no answer within {timeout_s:g} s ({exc.reason})") from exc
            time.sleep(0.05)
        self.ollama = _answers(lambda: self.request("GET", "/api/version"))
        pid = listening_pid(self.address)
        if pid != self.pid:
            self._release()
            self.pid, self._pinned = pid, None
            with contextlib.suppress(OSError, psutil.Error):
                self.affinity = Affinity(pid) if pid is not None else None
        self.in_flight = 0
        return self.status()

    def engine_started(self, config: EngineConfig) -> None:
        """The settings it is governed with from now on (the supervisor's, before it looks for the server)."""
        with self._lock:
            self.running = config
        self.pace.cap = config.max_tokens_per_s

    def status(self) -> EngineStatus:
        with self._lock:
            running = self.running
        if running is None:
            raise EngineUnavailable(Path(self.url), "no settings yet")
        return EngineStatus(
            **running.model_dump(),
            busy=self.in_flight > 0,
            loaded=True,
            pid=self.pid,
            engine=self.capabilities.engine,
            url=self.url,
        )

    def _answers_now(self) -> EngineStatus:
        self.request("GET", "/v1/models")  # it answers: the status stream is the liveness probe
        return self.status()

    def on_chat(self, started: bool) -> None:
        """A chat through the public socket came in or ended: what makes it busy (the server says nothing)."""
        with self._lock:
            self.in_flight = max(0, self.in_flight + (1 if started else -1))
        self.poll.kick()

    # -- what it is told ------------------------------------------------------------------------------------------
    def apply(self, config: EngineConfig) -> None:
        with self._lock:
            self.running = config
        self.pace.cap = config.max_tokens_per_s
        if self.affinity is not None and self._pinned != config.threads:
            try:
                self.affinity.pin(config.threads)
                self._pinned = config.threads
            except OSError:
                self._log.warning("threads not pinned", error=self.affinity.error)
                self.affinity = None  # the capabilities say so from now on

    def pause(self, reason: str | None) -> None:
        """Nothing fits in memory: the governor cannot unload an external server's model (new requests wait)."""

    def prepare_restart(self, config: EngineConfig) -> None:
        """Never called: an external engine is never restarted (its capabilities have no restart)."""

    def rewrite(self, path: str, body: bytes) -> bytes:
        """A request on its way to the server, with the settings decided: Ollama's per-request options on its native
        API, the decided tier's model name where a map is configured. A body that is not a JSON object goes as is."""
        config = self.running
        if config is None or not body or (path not in OLLAMA_PATHS and path not in OPENAI_PATHS):
            return body
        try:
            request = json.loads(body)
        except ValueError:
            return body
        if not isinstance(request, dict):
            return body
        if path in OLLAMA_PATHS and self.ollama:
            request = ollama_options(request, config, self._options().keep_alive_s)
        if config.model in self.models and request.get("model") in {None, "", *self.models.values()}:
            request["model"] = self.models[config.model]
        return json.dumps(request).encode()

    def close(self) -> None:
        self.interrupt_streams()
        self._release()
        self._http.close()

    def _release(self) -> None:
        if self.affinity is not None:
            self.affinity.restore()
            self.affinity = None

    def request(self, method: str, path: str, *, json_body: object = None) -> httpx.Response:
        try:
            response = self._http.request(method, path, json=json_body)
        except httpx.TransportError as exc:
            raise EngineUnavailable(Path(self.url), f"cannot reach {self.url} ({exc!s:.200})") from exc
        if response.is_error:
            raise EngineError(Path(self.url), response.status_code, response.text.strip()[:200])
        return response


def ollama_options(request: dict[str, Any], config: EngineConfig, keep_alive_s: float) -> dict[str, Any]:
    """Ollama's /api/chat or /api/generate body with the decision's threads and context (no more context than the
    client asked for) and, where the client set none, the policy's idle unload (`keep_alive`, in seconds)."""
    options = request.get("options")
    options = dict(options) if isinstance(options, dict) else {}
    options["num_thread"] = config.threads
    asked = options.get("num_ctx")
    options["num_ctx"] = min(asked, config.n_ctx) if isinstance(asked, int) and asked > 0 else config.n_ctx
    out = {**request, "options": options}
    if "keep_alive" not in request and keep_alive_s > 0:
        out["keep_alive"] = f"{keep_alive_s:g}s"
    return out


def _answers(call: Callable[[], object]) -> bool:
    try:
        call()
    except EngineError:
        return False
    return True


class ExternalSupervisor(EngineSupervisor):
    """Supervision of a server the governor does not start: ready while it answers. Its settings go to the driver
    when it is found (the per-request options, the affinity); a server that stops answering is waited for, not
    restarted, and requests meanwhile wait on the public socket, then get 503 saying why."""

    def __init__(self, driver: External, **kwargs: Any) -> None:
        super().__init__(command=driver.command, **kwargs)
        self.driver = driver

    def _ours(self, status: BaseModel, pid: int | None) -> bool:
        """An external engine is nobody's child: whatever answers at its URL is it."""
        return True

    def availability(self) -> Availability:
        """While it does not answer, a request waits (the hold), then gets 503 saying so."""
        avail = super().availability()
        if avail.ready or avail.given_up or self.status.waiting is not None:
            return avail
        why = self.status.last_exit or f"the external engine at {self.driver.url} does not answer yet"
        return Availability(False, False, why, max(1, math.ceil(self.restart.probe_interval_s)))

    def _supervise_once(self) -> bool:
        config = self._allowed_desired()
        if config is None:
            return False
        self.driver.engine_started(config)  # as a command line is for a managed engine: what its status reports
        # (once ready, the owner of the settings sends them: then its threads are pinned)
        if self._ready(self.restart.probe_interval_s) is None:
            with self._lock:
                self.status.last_exit = f"the external engine at {self.driver.url} does not answer"
            self._stop.wait(self.restart.initial_s)
            return True
        with self._lock:
            st = self.status
            st.running, st.ready, st.pid = True, True, self.driver.pid
            st.starts += 1
            start = st.starts
        self.desired.engine_ready(start, config, lambda: None)
        self._log.info("external engine answers", url=self.driver.url, pid=self.driver.pid, ollama=self.driver.ollama)
        self._on_change()
        while not self._stop.wait(self.restart.probe_interval_s) and self._answers(self.driver.pid):
            pass
        self.desired.engine_gone()
        with self._lock:
            st.running, st.ready, st.pid = False, False, None
            st.last_exit = f"the external engine at {self.driver.url} stopped answering"
        if not self._stop.is_set():
            self._log.warning("external engine stopped answering", url=self.driver.url)
            self._on_change()
        return not self._stop.is_set()
