"""The HTTP side: an OpenAI-compatible chat and completions API and the engine's control API, on the event loop.

Requests are validated once (pydantic, strict), never per token; an answer's way out (the worker → loop hand-off,
the SSE response) is governor.engine.stream; the OpenAI error shape and the bounded request bodies are
governor.engine.httpio.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Annotated, Any

import psutil
from pydantic import BaseModel, ConfigDict, StringConstraints, TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from governor.engine import fault, refusals
from governor.engine.adapters import split_model
from governor.engine.chat import ChatRequest, CompletionRequest
from governor.engine.config import Applied, ConfigRefused, resolve
from governor.engine.events import Ended, Event, Failed, ModelChanged, Started, Text, Trimmed
from governor.engine.feed import StatusFeed
from governor.engine.grammar import Constraint, SchemaRefused, constraint, pointer_to_param
from governor.engine.httpio import error, parse_body, validation_error
from governor.engine.jobs import ConfigJob, Job
from governor.engine.replies import CompletionReply, Reply, ToolReply
from governor.engine.stream import Events, EventStream, sse, stream_interval_s, watch_disconnect
from governor.engine.worker import Worker
from policies.decision import EngineConfig

MAX_CHAT_BODY = 8 << 20  # bytes; the largest context (1M tokens) is about 4 MB of text
MAX_CONFIG_BODY = 64 << 10
_OBJECT: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])


class Pause(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reason: Annotated[str, StringConstraints(min_length=1, max_length=400)] | None


_PAUSE: TypeAdapter[Pause] = TypeAdapter(Pause)


class EngineApp:
    def __init__(
        self,
        worker: Worker,
        *,
        queue_max: int = 8,
        drain_s: float = 10.0,
        load_wait_s: float = 60.0,
        stream_interval_ms: float | None = None,
    ) -> None:
        self.worker = worker
        self.stream_interval_ms = stream_interval_ms  # None: auto (governor.engine.stream.stream_interval_s)
        self.queue_max = queue_max
        self.drain_s = drain_s
        self.load_wait_s = load_wait_s  # how long a request may wait on a model load before a 503
        self._process = psutil.Process()
        self.rejected_total = 0
        self._configuring = asyncio.Lock()
        self._asked: EngineConfig | None = None  # the settings the last config change asked for, until it settles
        self.feed = StatusFeed(self.status_body, lambda: worker.busy)
        worker.on_change = self.feed.changed
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/engine/status", self.status, methods=["GET"]),
                Route("/engine/events", self.events, methods=["GET"]),
                Route("/engine/config", self.config, methods=["POST"]),
                Route("/engine/pause", self.pause, methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_error, Exception: self._server_error},
        )

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            code="not_found" if exc.status_code == 404 else None,
        )

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        return error(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")

    async def models(self, request: Request) -> Response:
        w = self.worker
        current, loaded = w.settings.model, w.slot.loaded
        data = []
        for name, spec in w.models.items():
            entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "governor"}
            entry |= {"tier": name, "loaded": loaded and name == current, "current": name == current}
            entry["context_length"] = w.settings.n_ctx if name == current else spec.default_ctx
            entry["max_context_length"] = spec.max_ctx
            data.append(entry)
        m = w.slot.current
        for name, a in w.adapters.items():  # a request picks one with "TIER:ADAPTER"; it runs on the current tier
            entry = {"id": f"{a.base}:{name}", "object": "model", "created": 0, "owned_by": "governor"}
            entry |= {"tier": a.base, "adapter": name, "scale": a.scale, "size_bytes": a.bytes, "error": a.error}
            entry |= {"loaded": m is not None and name in m.adapters, "active": m is not None and m.adapter == name}
            data.append(entry)
        return JSONResponse({"object": "list", "data": data})

    def status_body(self) -> dict[str, Any]:
        w = self.worker
        current = w.slot.current
        return {
            **w.settings.model_dump(),
            "model_path": str(w.models[w.settings.model].path),
            "loaded": w.slot.loaded,
            "paused": w.paused,
            "loading": None if w.slot.progress is None else w.slot.progress.as_dict(),
            "keep_alive_s": w.slot.keep_alive_s or 0,
            "last_load_s": None if w.slot.last_load_s is None else round(w.slot.last_load_s, 3),
            "loads_total": w.slot.loads_total,
            "unloads_total": w.slot.unloads_total,
            "context_shift": w.context_shift,
            "stream_interval_ms": round(stream_interval_s(self.stream_interval_ms, w.settings.threads) * 1000, 3),
            "extra_buffers": w.extra_buffers.as_dict(),
            "weight_buffers_mib": w.slot.weight_buffers_mib,
            "busy": w.busy,
            "tokens_per_s": round(w.tokens_per_s(), 3),
            "decode_tokens_per_s": None if w.decode_tokens_per_s is None else round(w.decode_tokens_per_s, 3),
            "context_tokens": None if current is None else current.context_tokens,
            "lora_pool": w.slot.pool.status(current),
            "queue_length": w.waiting,
            "queue_max": self.queue_max,
            **_memory(self._process),
            "pid": os.getpid(),
            **vars(w.counters),
            "rejected_total": self.rejected_total,
        }

    async def status(self, request: Request) -> Response:
        return JSONResponse(self.status_body())

    async def events(self, request: Request) -> Response:
        """The status as JSON lines, pushed on change (governor/engine/feed.py)."""
        raw = request.query_params.get("heartbeat_s")
        heartbeat_s: float | None = None
        if raw is not None:
            try:
                heartbeat_s = float(raw)
            except ValueError:
                heartbeat_s = math.nan
            if not 0.1 <= heartbeat_s <= 3600:
                return error(400, f"heartbeat_s={raw!r}: a number of seconds in [0.1, 3600]", param="heartbeat_s")
        return StreamingResponse(
            self.feed.lines(heartbeat_s, request.receive),
            media_type="application/x-ndjson",
            headers={"Cache-Control": "no-cache"},
        )

    async def config(self, request: Request) -> Response:
        # Any subset of the settings, validated by the one settings model (merged into the current ones).
        body = await parse_body(request, MAX_CONFIG_BODY, _OBJECT.validate_json)
        if isinstance(body, Response):
            return body
        loop = asyncio.get_running_loop()
        result: asyncio.Future[tuple[EngineConfig, Applied, float]] = loop.create_future()

        carried: list[dict[str, Any]] = []

        def done(settings: EngineConfig, applied: Applied, seconds: float) -> None:
            carry = self.worker.slot.pool.last_carry  # what a reload kept of the adapters, read on the worker
            if applied == "reload" and carry is not None:
                carried.append(carry.as_dict())
            loop.call_soon_threadsafe(_settle, result, (settings, applied, seconds), None)

        def fail(exc: Exception) -> None:
            loop.call_soon_threadsafe(_settle, result, None, exc)

        async with self._configuring:  # one at a time: each is merged into the settings the one before asked for
            base = self._asked if self._asked is not None else self.worker.settings
            try:
                asked = base.change(body)
                # Resolved once, here, before touching the model (the worker runs the result as it is); in a thread:
                # the first check of a quantized KV type for a model file not loaded yet reads its header (~1 s).
                change = {name: getattr(asked, name) for name in body}
                target = await asyncio.to_thread(resolve, base, change, self.worker.models)
            except ValidationError as exc:
                return validation_error(exc)
            except ConfigRefused as exc:
                return error(exc.status, exc.message, param=exc.param, code=exc.code)
            self._asked, job = target, ConfigJob(target, done, fail)
            self.worker.configure(job)
        try:
            settings, applied, seconds = await result
        except ConfigRefused as exc:
            return error(exc.status, exc.message, param=exc.param, code=exc.code)
        finally:
            if self._asked is target:  # nothing newer asked for: the next change merges into the settings in force
                self._asked = None
        body = {"config": settings.model_dump(), "applied": applied, "seconds": round(seconds, 4)}
        if carried:  # a reload that had adapters loaded: which it kept, which it dropped and why
            body["adapters"] = carried[0]
        return JSONResponse(body | {"tokens_waited": job.tokens_waited})

    async def pause(self, request: Request) -> Response:
        """{"reason": "..."}: unload the model at the next token boundary and keep it unloaded, the running answer
        and the queue waiting (the daemon's memory wait); {"reason": null}: load again and continue. Returns at once:
        `/engine/status` shows `paused` and `loaded`."""
        body = await parse_body(request, MAX_CONFIG_BODY, _PAUSE.validate_json)
        if isinstance(body, Response):
            return body
        self.worker.pause(body.reason)
        return JSONResponse({"paused": self.worker.paused, "loaded": self.worker.slot.loaded})

    async def chat(self, request: Request) -> Response:
        req = await parse_body(request, MAX_CHAT_BODY, ChatRequest.model_validate_json)
        if isinstance(req, Response):
            return req
        refused = refusals.check(req)
        if refused is not None:
            return error(400, refused.message, param=refused.param, code=refused.code)
        try:
            wanted = constraint(req)
        except SchemaRefused as exc:
            return error(400, str(exc), param=pointer_to_param(exc.where), code="unsupported_schema")
        return await self._answer(request, req, wanted, ToolReply if wanted.tools else Reply)

    async def completions(self, request: Request) -> Response:
        req = await parse_body(request, MAX_CHAT_BODY, CompletionRequest.model_validate_json)
        if isinstance(req, Response):
            return req
        refused = refusals.check(req)
        if refused is not None:
            return error(400, refused.message, param=refused.param, code=refused.code)
        return await self._answer(request, req, Constraint(None, None), CompletionReply)

    async def _answer(
        self, request: Request, req: ChatRequest | CompletionRequest, wanted: Constraint, shape: type[Reply]
    ) -> Response:
        adapter = self._adapter(req)
        if isinstance(adapter, Response):
            return adapter
        if self.worker.load() > self.queue_max:
            self.rejected_total += 1
            retry = max(1, min(60, math.ceil((self.worker.generation_s or 1.0) * (self.worker.waiting + 1))))
            return error(
                429,
                f"the engine's queue is full ({self.queue_max} waiting); retry later",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            )
        fault.maybe_crash("decode", self.worker.settings.model)
        interval = stream_interval_s(self.stream_interval_ms, self.worker.settings.threads)
        events = Events(asyncio.get_running_loop(), eager=req.stream, interval_s=interval)
        job = Job(req, events, wanted, adapter=adapter)
        self.worker.submit(job)
        watcher = asyncio.ensure_future(watch_disconnect(request.receive, events))

        def close() -> None:
            watcher.cancel()
            if not events.ended:
                self.worker.cancel(job)

        streaming = False
        try:
            first, waited = await self._first(events)
            if first is None:
                return Response(status_code=499) if events.gone else self._load_too_long(waited)
            match first[0]:
                case Failed(status, message, code):
                    return error(status, message, code=code)
                case Started(model, _prompt_tokens, trimmed):
                    reply = shape(model)
                    reply.governor["trimmed_messages"] = trimmed
                case other:
                    raise AssertionError(f"an answer began with {other}")
            # This request loaded the model (after an idle unload): say how long that took.
            headers = {"X-Governor-Load-S": f"{job.load_s:.3f}"} if job.load_s else {}
            if not req.stream:
                response = await self._collect(events, first[1:], reply)
                response.headers.update(headers)
                return response
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            streaming = True  # the response closes from now on
            return EventStream(sse(events, first[1:], reply, include_usage), on_close=close, headers=headers)
        finally:
            if not streaming:
                close()

    def _adapter(self, req: ChatRequest | CompletionRequest) -> str | Response | None:
        """The LoRA adapter a request asks for ("model": "TIER:ADAPTER", or "governor": {"adapter": ...}), or the
        4xx/5xx that says why it cannot have it (checked before it waits in the queue)."""
        w = self.worker
        try:
            _tier, adapter = split_model(req.model, w.models, w.adapters)
        except KeyError as exc:
            return error(404, str(exc.args[0]), param="model", code="model_not_found")
        asked = None if req.governor is None else req.governor.adapter
        if asked is not None:
            if asked not in w.adapters:
                known = list(w.adapters) or "none"
                message = f"unknown adapter {asked!r}; this engine has {known}"
                return error(404, message, param="governor.adapter", code="model_not_found")
            if adapter is not None and adapter != asked:
                message = f"model names adapter {adapter!r} but governor.adapter {asked!r}"
                return error(400, message, param="governor.adapter", code="conflicting_adapters")
            adapter = asked
        if adapter is not None and w.adapters[adapter].error is not None:
            message = f"adapter {adapter!r} cannot be used: {w.adapters[adapter].error}"
            return error(500, message, param="model", code="adapter_invalid")
        return adapter

    async def _first(self, events: Events) -> tuple[list[Event] | None, float]:
        """The first events of an answer, and how long it waited behind a model load. None when the client went
        away, or when a load kept it waiting `load_wait_s` (then the caller answers 503)."""
        task = asyncio.ensure_future(events.batch())
        waited, tick = 0.0, 0.25
        try:
            while True:
                loading = self.worker.slot.progress is not None
                if loading and waited >= self.load_wait_s:
                    return None, waited
                await asyncio.wait({task}, timeout=tick)
                if task.done():
                    return task.result(), waited
                if loading:
                    waited += tick  # only time spent behind a load counts; behind answers the queue limit rules
        finally:
            task.cancel()

    def _load_too_long(self, waited_s: float) -> Response:
        progress = self.worker.slot.progress
        remaining = None if progress is None else progress.remaining_s(time.monotonic())
        retry = max(1, min(300, math.ceil(remaining if remaining is not None else waited_s)))
        fraction = 1.0 if progress is None else progress.fraction
        return error(
            503,
            f"the model is still loading ({fraction:.0%} after {waited_s:.1f} s of waiting); retry in {retry} s",
            code="model_loading",
            headers={"Retry-After": str(retry), "X-Governor-Load-Progress": f"{fraction:.4f}"},
        )

    async def _collect(self, events: Events, backlog: list[Event], reply: Reply) -> Response:
        batch: list[Event] | None = backlog
        while batch is not None:
            for ev in batch:
                match ev:
                    case Text(text):
                        reply.collect(text)
                    case Trimmed(total):
                        reply.governor["trimmed_messages"] = total
                    case ModelChanged(model):
                        reply.set_model(model)
                    case Failed(status, message, code):
                        return error(status, message, code=code)
                    case Ended(finish, usage, governor):
                        reply.governor.update(governor)
                        return JSONResponse(reply.full(finish, usage))
            batch = await events.batch()
        return Response(status_code=499)


def _settle(fut: asyncio.Future[Any], value: Any, exc: Exception | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _memory(process: psutil.Process) -> dict[str, int]:
    """The process's resident memory, and of it what is not file-backed (Linux: `shared` is RssFile + RssShmem)."""
    info = process.memory_info()
    shared = getattr(info, "shared", None)
    out = {"rss_bytes": info.rss}
    if shared is not None:
        out["anon_bytes"] = max(0, info.rss - shared)
    return out
