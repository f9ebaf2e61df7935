"""A client for the engine's socket: its control API (`/engine/status`, `/engine/config`) and its OpenAI API.

The daemon's llama-cpp-python driver (governor/daemon/llamacpp.py) talks through it: `observe()` reads the status as an
`EngineObservation` (None while the engine cannot be reached), `apply()` posts a whole `policies.decision.EngineConfig`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import httpcore
import httpx
import structlog
from httpcore._backends.sync import SyncStream
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govbase.errors import GovernorError
from policies.decision import EngineConfig
from sensors.snapshot import BYTES_MAX, TOKENS_PER_S_MAX, EngineObservation

CONFIG_FIELDS = frozenset(EngineConfig.model_fields)
M = TypeVar("M", bound=BaseModel)


class EngineError(GovernorError):
    """The engine answered with an error (`status` is its HTTP status) or could not be reached (`status` None)."""

    def __init__(
        self, socket_path: Path, status: int | None, message: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        where = f"engine at {socket_path}"
        super().__init__(f"{where}: HTTP {status}: {message}" if status is not None else f"{where}: {message}")
        self.socket_path = socket_path
        self.status = status
        self.reason = message
        self.code = code
        self.param = param


class EngineUnavailable(EngineError):
    """No answer: the socket is missing, nobody listens, or the request timed out."""

    def __init__(self, socket_path: Path, message: str) -> None:
        super().__init__(socket_path, None, message)


class _Response(BaseModel):
    # The engine may add fields; the client keeps them (`model_extra`) rather than refusing a newer engine.
    model_config = ConfigDict(frozen=True, extra="allow")


class EngineStatus(EngineConfig):
    """`GET /engine/status`: the settings in force, and what the engine is doing."""

    # The engine may add fields; the client keeps them (`model_extra`) rather than refusing a newer engine.
    model_config = ConfigDict(extra="allow")

    busy: bool
    tokens_per_s: float | None = Field(default=None, ge=0, le=TOKENS_PER_S_MAX)
    queue_length: int = Field(default=0, ge=0, le=1 << 20)
    context_tokens: int | None = Field(default=None, ge=0, le=1 << 20)  # bounded as n_ctx is (policies' `Ctx`)
    rss_bytes: int | None = Field(default=None, ge=0, le=BYTES_MAX)
    anon_bytes: int | None = Field(default=None, ge=0, le=BYTES_MAX)
    loaded: bool | None = None  # None: an engine from before idle unload
    paused: str | None = None  # why the model is held unloaded (POST /engine/pause)

    def observation(self) -> EngineObservation:
        """What the policy sees of the engine."""
        return EngineObservation(
            busy=self.busy,
            tokens_per_s=self.tokens_per_s,
            model=self.model,
            rss_bytes=self.rss_bytes,
            anon_bytes=self.anon_bytes,
            loaded=self.loaded,
            threads=self.threads,  # what tokens_per_s was measured at (policies/contention.py)
            context_tokens=self.context_tokens,  # the memory ceiling falls as it fills (policies/devicemodel.py)
        )


class ConfigResult(_Response):
    """`POST /engine/config`: the settings now in force, how they were applied and how long it took."""

    config: EngineConfig
    applied: str  # "live" or "reload"
    seconds: float


class _ClosingBackend(httpcore.SyncBackend):
    """httpcore 1.0 leaks the socket of a failed Unix-socket connect (a ResourceWarning per refused attempt, and
    `wait_ready` makes many); this backend closes it."""

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.NetworkStream:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            sock.settimeout(timeout)
            sock.connect(path)
        except TimeoutError as exc:
            sock.close()
            raise httpcore.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            sock.close()
            raise httpcore.ConnectError(str(exc)) from exc
        return SyncStream(sock)


class _UnixTransport(httpx.HTTPTransport):
    def __init__(self, path: Path) -> None:
        super().__init__(uds=str(path))
        self._pool = httpcore.ConnectionPool(uds=str(path), network_backend=_ClosingBackend())


class EngineClient:
    """Talks to one engine over its Unix socket. Thread-safe (one `httpx.Client`); close it, or use `with`."""

    def __init__(self, socket_path: Path, timeout_s: float = 10.0, *, reload_timeout_s: float = 300.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.reload_timeout_s = reload_timeout_s  # a model reload on a slow device takes a while
        self._http = httpx.Client(transport=_UnixTransport(socket_path), base_url="http://engine", timeout=timeout_s)
        self._streams: set[httpx.Response] = set()
        self._log = structlog.get_logger("governor.engine.client")

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.interrupt_streams()
        self._http.close()

    # -- control API ---------------------------------------------------------------------------------------------

    def status(self) -> EngineStatus:
        return self._parse(EngineStatus, self._request("GET", "/engine/status"))

    def configure(self, **fields: int | float | str | None) -> ConfigResult:
        """Change any subset of the settings (`policies.decision.EngineConfig`'s fields; None removes a cap).

        Blocks until the engine has applied it, live or by a reload at the next token boundary.
        """
        unknown = set(fields) - CONFIG_FIELDS
        if unknown:
            raise TypeError(f"configure() got unknown fields {sorted(unknown)}; allowed: {sorted(CONFIG_FIELDS)}")
        response = self._request("POST", "/engine/config", json=fields, timeout_s=self.reload_timeout_s)
        return self._parse(ConfigResult, response)

    def pause(self, reason: str | None) -> None:
        """Unload the model and keep it unloaded, saying why; the running answer waits with its stream open (None:
        load again and continue it). Returns at once; `status().paused` / `.loaded` show where the engine is."""
        self._request("POST", "/engine/pause", json={"reason": reason})  # raises the engine's error
        self._log.info("engine paused" if reason is not None else "engine resumed", reason=reason)

    def wait_ready(self, timeout_s: float = 60.0, *, process: subprocess.Popen[Any] | None = None) -> EngineStatus:
        """Poll the status until the engine answers; with `process`, fail as soon as that process exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.status()
            except EngineUnavailable as exc:
                last = exc
            if process is not None and process.poll() is not None:
                raise EngineUnavailable(self.socket_path, f"the engine process exited with code {process.returncode}")
            if time.monotonic() > deadline:
                raise EngineUnavailable(self.socket_path, f"not ready within {timeout_s:g} s ({last.reason})")
            time.sleep(0.05)

    def events(self, *, heartbeat_s: float | None = None) -> Generator[EngineStatus, None, None]:
        """`GET /engine/events`: the status now and each time it changes, on one connection (close to stop).

        With `heartbeat_s` the engine writes at least that often, and silence for three heartbeats is an error; a
        heartbeat that brings nothing new (a blank line) yields the last status again, the same object.
        """
        params = {} if heartbeat_s is None else {"heartbeat_s": heartbeat_s}
        timeout = self._timeout(None if heartbeat_s is None else 3 * heartbeat_s)
        try:
            with self._http.stream("GET", "/engine/events", params=params, timeout=timeout) as response:
                if response.is_error:
                    response.read()
                    raise self._error(response)
                self._streams.add(response)
                try:
                    last: EngineStatus | None = None
                    for line in response.iter_lines():
                        if line:
                            last = self._parse_json(EngineStatus, line, response)
                        if last is not None:
                            yield last
                finally:
                    self._streams.discard(response)
        except httpx.TransportError as exc:
            raise EngineUnavailable(self.socket_path, _transport_reason(exc)) from exc
        raise EngineUnavailable(self.socket_path, "the status stream ended")

    def interrupt_streams(self) -> None:
        """End every open `events()` stream now, from any thread (its reader sees EngineUnavailable)."""
        for response in list(self._streams):
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    # -- what the daemon's driver uses -------------------------------------------------------------------------------

    def observe(self) -> EngineObservation | None:
        """The engine as the loop sees it; None (and a log line) while it cannot be reached or answers an error."""
        try:
            s = self.status()
        except EngineError as exc:
            self._log.warning("engine status unavailable", error=str(exc))
            return None
        return s.observation()

    def apply(self, config: EngineConfig) -> None:
        """Post the whole decision; the engine applies live what it can and reloads only for model, n_ctx or kv_type."""
        result = self.configure(**config.model_dump())
        self._log.info(
            "engine configured",
            applied=result.applied,
            seconds=round(result.seconds, 3),
            **result.config.model_dump(),
        )

    # -- OpenAI API ----------------------------------------------------------------------------------------------

    def models(self) -> list[str]:
        data = self._request("GET", "/v1/models").json()
        try:
            return [str(m["id"]) for m in data["data"]]
        except (KeyError, TypeError) as exc:
            raise EngineError(self.socket_path, 200, f"unexpected /v1/models answer: {data!r:.200}") from exc

    def chat(self, messages: Sequence[Mapping[str, str]], *, model: str = "default", **params: Any) -> dict[str, Any]:
        """A non-streamed chat completion: the OpenAI response as a dict."""
        body = {"model": model, "messages": list(messages), **params, "stream": False}
        result: dict[str, Any] = self._request("POST", "/v1/chat/completions", json=body, timeout_s=None).json()
        return result

    def stream_chat(
        self, messages: Sequence[Mapping[str, str]], *, model: str = "default", **params: Any
    ) -> Generator[dict[str, Any], None, None]:
        """A streamed chat completion: each SSE chunk as a dict; an error event raises `EngineError`. Closing the
        iterator disconnects (and cancels)."""
        body = {"model": model, "messages": list(messages), **params, "stream": True}
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body, timeout=self._timeout(None)) as response:
                if response.is_error:
                    response.read()
                    raise self._error(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if isinstance(chunk.get("error"), dict):  # as the openai SDK does: an error event raises
                        err = chunk["error"]
                        message = " ".join(str(err.get("message") or "error event in the stream").split())
                        raise EngineError(self.socket_path, response.status_code, message, code=err.get("code"))
                    yield chunk
        except httpx.TransportError as exc:
            raise EngineUnavailable(self.socket_path, _transport_reason(exc)) from exc

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _timeout(self, timeout_s: float | None) -> httpx.Timeout:
        """`None` = no limit on reading (a long answer), but connecting still times out."""
        return httpx.Timeout(timeout_s, connect=self.timeout_s)

    def _request(
        self, method: str, path: str, *, json: object = None, timeout_s: float | Literal["default"] | None = "default"
    ) -> httpx.Response:
        timeout = self._timeout(self.timeout_s if timeout_s == "default" else timeout_s)
        try:
            response = self._http.request(method, path, json=json, timeout=timeout)
        except httpx.TransportError as exc:
            raise EngineUnavailable(self.socket_path, _transport_reason(exc)) from exc
        if response.is_error:
            raise self._error(response)
        return response

    def _error(self, response: httpx.Response) -> EngineError:
        """The OpenAI error shape {"error": {"message", "code", "param"}}, else FastAPI's {"detail"}, else the text."""
        code = param = None
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            err = body["error"]
            message = str(err.get("message") or response.reason_phrase)
            code, param = err.get("code"), err.get("param")
        elif isinstance(body, dict) and "detail" in body:
            message = str(body["detail"])
        else:
            message = response.text.strip()[:200] or response.reason_phrase
        return EngineError(self.socket_path, response.status_code, " ".join(message.split()), code=code, param=param)

    def _parse(self, model: type[M], response: httpx.Response) -> M:
        return self._parse_json(model, response.content, response)

    def _parse_json(self, model: type[M], data: str | bytes, response: httpx.Response) -> M:
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise EngineError(
                self.socket_path, response.status_code, f"unexpected {response.url.path} answer: {where}: {err['msg']}"
            ) from exc


def _transport_reason(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in time ({type(exc).__name__})"
    cause = exc.__cause__ or exc.__context__
    while cause is not None and cause.__cause__ is not None:
        cause = cause.__cause__
    reason = str(cause or exc) or type(exc).__name__
    return f"cannot connect ({reason})"
