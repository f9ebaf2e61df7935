"""Where a chat request runs: on the device, or at the first healthy upstream (docs/routing.md).

The `Router` is a loop listener (each tick it judges the device against the policy's `[slo]`, with hysteresis,
from the decision and the engine's measured decode speed) and the proxy's adviser (per request: the engine's
availability, its queue, the prompt's predicted time to first token, and the request's own `local_only`). It keeps
the upstreams' health, the recent routes for `governor status` / `why`, and counts them in the Prometheus registry.
API keys are read here at start and live only in `UpstreamLink`; nothing here logs or shows them.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from govbase.errors import GovernorError
from governor.daemon.config import Upstream
from governor.daemon.proxylink import CLASS_HEADER, LOCAL_ONLY_HEADER
from governor.daemon.restarts import Availability
from governor.daemon.secrets import Scrubber
from policies.decision import Decision
from policies.schema import Policy
from policies.slo import Measured, Prediction, RouteGate, predict
from sensors.snapshot import EngineObservation, Snapshot

HISTORY = 50
CHARS_PER_TOKEN = 4.0  # the prompt-length estimate; prefill speed is measured in the same unit, so it cancels out
PREFILL_EWMA = 0.3
MAX_KEY_BYTES = 8192


class RoutingError(GovernorError):
    pass


def read_key(upstream: Upstream, env: Mapping[str, str]) -> str | None:
    """The upstream's API key from its file or environment variable (one-line error naming where, never the key)."""
    if upstream.api_key_env is not None:
        key = env.get(upstream.api_key_env)
        if not key:
            raise RoutingError(f"upstream {upstream.name}: environment variable {upstream.api_key_env} is not set")
        return key.strip()
    if upstream.api_key_file is not None:
        where = f"upstream {upstream.name}: api_key_file {upstream.api_key_file}"
        try:
            # Non-blocking, and a regular file only: a FIFO there blocked `governor run` forever (issue 33).
            fd = os.open(upstream.api_key_file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise RoutingError(f"{where}: not a regular file")
                raw = os.read(fd, MAX_KEY_BYTES + 1)
            finally:
                os.close(fd)
        except OSError as exc:
            raise RoutingError(f"{where}: {exc.strerror}") from exc
        key = raw.decode(errors="replace").strip()
        if not key or len(raw) > MAX_KEY_BYTES or any(c in key for c in "\r\n\0"):
            raise RoutingError(f"{where}: not one key line")
        return key
    return None


class UpstreamLink:
    """One configured upstream as the proxy uses it: its key (never repr'd), its health."""

    def __init__(self, config: Upstream, key: str | None) -> None:
        self.config = config
        self.name = config.name
        self._key = key
        self.scrubber = Scrubber(key)
        self.down_until: float | None = None  # monotonic
        self.last_error: str | None = None
        self.requests = 0
        self.errors = 0

    def __repr__(self) -> str:
        return f"UpstreamLink({self.name!r})"

    def auth_headers(self) -> list[tuple[bytes, bytes]]:
        return [] if self._key is None else [(b"authorization", b"Bearer " + self._key.encode())]

    def scrub(self, text: str) -> str:
        """An upstream's error text with its key taken out, in any encoding, should it echo it back."""
        return self.scrubber.text(text)

    def healthy(self, now: float) -> bool:
        return self.down_until is None or now >= self.down_until

    def model_for(self, requested: str | None, local_tier: str | None) -> str | None:
        cfg = self.config
        for name in (requested, local_tier):
            if name is not None and name in cfg.models:
                return cfg.models[name]
        return cfg.model if cfg.model is not None else requested


@dataclass(frozen=True)
class Route:
    upstream: UpstreamLink | None
    kind: str  # a small fixed set: the Prometheus label (slo, ttft, engine_unavailable, queue_full, ...)
    reason: str  # the sentence for the client's `governor` field, status and why

    @property
    def label(self) -> str:
        return "local" if self.upstream is None else f"upstream:{self.upstream.name}"


@dataclass(frozen=True)
class ChatInfo:
    """What routing needs of a chat request body; `body` is what goes on (without our `governor` field)."""

    body: bytes
    local_only: bool
    stream: bool
    model: str | None
    prompt_tokens: int
    data: dict[str, Any] | None  # the parsed body (None: not a JSON object; the engine answers that)
    background: bool = False  # `"governor": {"class": "background"}`: judged against [slo.background]


def chat_info(raw: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> ChatInfo:
    """The body's `governor` object (taken out) and the headers `x-governor-local-only: 1` and
    `x-governor-class: background` say how the request may be routed."""
    said = {k.lower(): v.strip() for k, v in headers if k.lower() in (LOCAL_ONLY_HEADER, CLASS_HEADER)}
    local_only_header = said.get(LOCAL_ONLY_HEADER) in (b"1", b"true")
    background_header = said.get(CLASS_HEADER) == b"background"
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        return ChatInfo(raw, local_only_header, False, None, 0, None, background_header)
    ours = data.pop("governor", None)
    local_only = local_only_header or (isinstance(ours, dict) and ours.get("local_only") is True)
    background = background_header or (isinstance(ours, dict) and ours.get("class") == "background")
    body = raw if ours is None else json.dumps(data).encode()
    chars = 0
    messages = data.get("messages")
    for message in messages if isinstance(messages, list) else []:  # anything else: the engine's 400 says why
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content) + 16  # the template's role markers
        elif isinstance(content, list):
            chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    model = data.get("model")
    return ChatInfo(
        body,
        local_only,
        data.get("stream") is True,
        model if isinstance(model, str) else None,
        int(chars / CHARS_PER_TOKEN) + 1,
        data,
        background,
    )


class Router:
    def __init__(
        self,
        upstreams: list[UpstreamLink],
        *,
        policy: Callable[[], Policy | None],
        engine_status: Callable[[], dict[str, Any] | None],
        metrics: Any = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.upstreams = upstreams
        self._policy, self._engine_status, self._metrics = policy, engine_status, metrics
        self._monotonic, self._wall = monotonic, wall
        self._lock = threading.Lock()
        self.gate = RouteGate()
        self.decision: Decision | None = None
        self.measured = Measured()
        self.strict: Prediction | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._log = structlog.get_logger("governor.routing")

    @property
    def enabled(self) -> bool:
        """Privacy by default: nothing leaves the device until an upstream is configured."""
        return bool(self.upstreams)

    # -- the loop's thread ---------------------------------------------------------------------------------------
    def on_tick(self, t: float, _s: Snapshot, observed: EngineObservation | None, decision: Decision) -> None:
        status = self._engine_status() or {}
        with self._lock:
            self.decision = decision
            decode = status.get("decode_tokens_per_s")
            if observed is not None and observed.busy and isinstance(decode, float | int) and decode > 0:
                # Only while generating is the EWMA about the threads in force now.
                self.measured = Measured(float(decode), observed.threads, *self._prefill())
            policy = self._policy()
            if policy is None or not self.enabled:
                return
            self.strict = predict(policy, decision, self.measured)
            with_margin = predict(policy, decision, self.measured, margin=policy.slo.back_margin)
            was = self.gate.off
            off = self.gate.update(t, policy.slo, self.strict, with_margin)
        if off != was:
            self._log.info("routing", off_device=off, reason=self.gate.reason)

    def _prefill(self) -> tuple[float | None, int | None]:
        return self.measured.prefill_tokens_per_s, self.measured.prefill_threads

    # -- the proxy's thread --------------------------------------------------------------------------------------
    def choose(self, info: ChatInfo, avail: Availability) -> Route:
        """Local, or the first healthy upstream, and why. A background request is judged on its own, against
        `[slo.background]` (the device-wide gate is about the interactive targets)."""
        background = info.background
        if not self.enabled:
            return Route(None, "routing_off", "routing is off (no upstream configured)")
        if info.local_only:
            return Route(None, "local_only", "the request asked to stay on the device (local_only)")
        with self._lock:
            status = self._engine_status() or {}
            if not avail.ready:
                kind, why = "engine_unavailable", avail.reason or "the engine is not ready"
            elif status.get("queue_max") is not None and status.get("queue_length", 0) >= status["queue_max"]:
                kind, why = "queue_full", f"the engine's queue is full ({status['queue_length']} waiting)"
            elif self.gate.off and not background:
                kind, why = "slo", f"the device cannot meet the target: {self.gate.reason}"
            else:
                policy = self._policy()
                one = None
                if policy is not None:
                    one = predict(policy, self.decision, self.measured, info.prompt_tokens, background=background)
                if one is None or one.meets:
                    said = "background targets" if background else self.gate.reason
                    return Route(None, "meets", f"the device meets the target ({said})")
                kind, why = one.kind, f"the device cannot take this request as it should: {one.reason}"
        upstream = self.first_healthy()
        if upstream is None:
            return Route(None, "no_upstream", f"{why}; no healthy upstream, so on the device")
        return Route(upstream, kind, why)

    def first_healthy(self, skip: set[str] | frozenset[str] = frozenset()) -> UpstreamLink | None:
        now = self._monotonic()
        return next((u for u in self.upstreams if u.healthy(now) and u.name not in skip), None)

    def engine_busy(self) -> bool:
        status = self._engine_status() or {}
        return bool(status.get("busy")) or bool(status.get("queue_length"))

    def local_tier(self) -> str | None:
        return None if self.decision is None else self.decision.engine.model

    def routed(self, route: Route, *, stream: bool, note: str | None = None) -> None:
        """A request's route, decided: history and counters (`note`: e.g. the fallback after an upstream failed)."""
        entry = {"wall": self._wall(), "route": route.label, "kind": route.kind, "reason": route.reason}
        if note:
            entry["note"] = note
        with self._lock:
            self.history.append(entry | {"stream": stream})
            if route.upstream is not None:
                route.upstream.requests += 1
        if self._metrics is not None:
            self._metrics.routed(route.label.split(":")[0], route.kind)

    def failed(self, upstream: UpstreamLink, *, phase: str, error: str) -> None:
        """The upstream failed (`before_first_token` / `after_first_token`): skipped for its retry_after_s."""
        error = upstream.scrub(error)[:300]
        with self._lock:
            upstream.errors += 1
            upstream.last_error = f"{phase.replace('_', ' ')}: {error}"
            upstream.down_until = self._monotonic() + upstream.config.retry_after_s
        self._log.warning("upstream failed", upstream=upstream.name, phase=phase, error=error)
        if self._metrics is not None:
            self._metrics.upstream_error(upstream.name, phase)

    def answered(self, route: Route, *, ttft_s: float | None, total_s: float) -> None:
        if self._metrics is not None:
            self._metrics.latency(route.label.split(":")[0], ttft_s, total_s)

    def local_ttft(self, prompt_tokens: int, ttft_s: float, *, idle: bool) -> None:
        """A local streamed answer's first token came `ttft_s` after the request (only counted when the engine was
        idle: time behind another answer is not prefill)."""
        if self._metrics is not None:
            self._metrics.latency("local", ttft_s, None)
        status = self._engine_status() or {}
        threads = status.get("threads")
        if not idle or ttft_s <= 0 or not isinstance(threads, int):
            return
        rate = prompt_tokens / ttft_s
        with self._lock:
            m = self.measured
            old = m.prefill_tokens_per_s if m.prefill_threads == threads else None
            new = rate if old is None else old + PREFILL_EWMA * (rate - old)
            self.measured = Measured(m.decode_tokens_per_s, m.decode_threads, new, threads)

    # -- status and why --------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = self._monotonic()
        policy = self._policy()
        with self._lock:
            m = self.measured
            return {
                "enabled": self.enabled,
                "slo": None if policy is None else policy.slo.model_dump(),
                "off_device": self.gate.off,
                "reason": self.gate.reason if self.enabled else "routing is off (no upstream configured)",
                "prediction": None if self.strict is None else self.strict.as_dict(),
                "measured": {
                    "decode_tokens_per_s": None if m.decode_tokens_per_s is None else round(m.decode_tokens_per_s, 2),
                    "decode_threads": m.decode_threads,
                    "prefill_tokens_per_s": None
                    if m.prefill_tokens_per_s is None
                    else round(m.prefill_tokens_per_s, 1),
                    "prefill_threads": m.prefill_threads,
                },
                "upstreams": [
                    {
                        "name": u.name,
                        "base_url": u.config.base_url,
                        "socket": None if u.config.socket is None else str(u.config.socket),
                        "api_key": "set" if u.auth_headers() else None,
                        "healthy": u.healthy(now),
                        "retry_in_s": None if u.healthy(now) else round((u.down_until or now) - now, 1),
                        "last_error": u.last_error,
                        "requests": u.requests,
                        "errors": u.errors,
                    }
                    for u in self.upstreams
                ],
                "last": list(self.history)[-10:],
            }

    def recent(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.history)[-n:]


def build_router(
    upstreams: tuple[Upstream, ...],
    env: Mapping[str, str],
    *,
    policy: Callable[[], Policy | None],
    engine_status: Callable[[], dict[str, Any] | None],
    metrics: Any = None,
) -> Router:
    for u in upstreams:
        if u.socket is not None and len(os.fsencode(u.socket)) >= 108:
            raise RoutingError(f"upstream {u.name}: socket {u.socket}: a Unix socket path must be under 108 bytes")
    links = [UpstreamLink(u, read_key(u, env)) for u in upstreams]
    return Router(links, policy=policy, engine_status=engine_status, metrics=metrics)
