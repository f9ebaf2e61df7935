"""The HTTP side: an OpenAI-compatible chat API and the engine's control API, on the event loop.

Requests are validated once (pydantic, strict), never per token; an answer's way out (the worker → loop hand-off,
the SSE response) is governor.engine.stream.
"""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

import psutil
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from governor.engine.chat import ChatRequest
from governor.engine.config import Applied, ConfigChange, ConfigRefused, Settings, resolve
from governor.engine.jobs import ConfigJob, Job
from governor.engine.stream import Event, Events, EventStream, Reply, sse, watch_disconnect
from governor.engine.worker import Worker


def error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


MAX_CHAT_BODY = 8 << 20  # bytes; the largest context (1M tokens) is about 4 MB of text
MAX_CONFIG_BODY = 64 << 10


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) before reading when Content-Length says it is too large, and while reading
    when a chunked body grows past `limit`: a 50 MB body never sits in the engine's memory."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int) -> JSONResponse:
    return error(413, f"request body larger than {limit} bytes", code="body_too_large")


def validation_error(exc: ValidationError) -> JSONResponse:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return error(400, f"malformed JSON body: {err['msg']}", code="invalid_json")
    where = ".".join(str(p) for p in err["loc"]) or None
    return error(400, f"{where or 'body'}: {err['msg']}", param=where, code=err["type"])


class EngineApp:
    def __init__(self, worker: Worker, *, queue_max: int = 8, drain_s: float = 10.0) -> None:
        self.worker = worker
        self.queue_max = queue_max
        self.drain_s = drain_s
        self._process = psutil.Process()
        self.rejected_total = 0
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/engine/status", self.status, methods=["GET"]),
                Route("/engine/config", self.config, methods=["POST"]),
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
        loaded = self.worker.settings.model
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "governor", "loaded": name == loaded}
            for name in self.worker.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def status(self, request: Request) -> Response:
        w = self.worker
        body = {
            **w.settings.as_dict(),
            "model_path": str(w.models[w.settings.model].path),
            "busy": w.busy,
            "tokens_per_s": round(w.tokens_per_s(), 3),
            "decode_tokens_per_s": None if w.decode_tokens_per_s is None else round(w.decode_tokens_per_s, 3),
            "queue_length": w.waiting,
            "queue_max": self.queue_max,
            "rss_bytes": self._process.memory_info().rss,
            "pid": os.getpid(),
            **vars(w.counters),
            "rejected_total": self.rejected_total,
        }
        return JSONResponse(body)

    async def config(self, request: Request) -> Response:
        try:
            change = ConfigChange.model_validate_json(await read_body(request, MAX_CONFIG_BODY))
            # Refuse now, before touching the model; in a thread: the first check of a quantized KV type for a
            # model file not loaded yet reads its header (up to a second).
            await asyncio.to_thread(resolve, self.worker.settings, change, self.worker.models)
        except BodyTooLarge:
            return too_large(MAX_CONFIG_BODY)
        except ValidationError as exc:
            return validation_error(exc)
        except ConfigRefused as exc:
            return error(exc.status, exc.message, param=exc.param, code=exc.code)
        loop = asyncio.get_running_loop()
        result: asyncio.Future[tuple[Settings, Applied, float]] = loop.create_future()

        def done(settings: Settings, applied: Applied, seconds: float) -> None:
            loop.call_soon_threadsafe(_settle, result, (settings, applied, seconds), None)

        def fail(exc: Exception) -> None:
            loop.call_soon_threadsafe(_settle, result, None, exc)

        self.worker.configure(ConfigJob(change, done, fail))
        try:
            settings, applied, seconds = await result
        except ConfigRefused as exc:
            return error(exc.status, exc.message, param=exc.param, code=exc.code)
        return JSONResponse({"config": settings.as_dict(), "applied": applied, "seconds": round(seconds, 4)})

    async def chat(self, request: Request) -> Response:
        try:
            req = ChatRequest.model_validate_json(await read_body(request, MAX_CHAT_BODY))
        except BodyTooLarge:
            return too_large(MAX_CHAT_BODY)
        except ValidationError as exc:
            return validation_error(exc)
        if req.model is not None and req.model not in self.worker.models:
            return error(
                404,
                f"unknown model {req.model!r}; this engine serves {list(self.worker.models)}",
                param="model",
                code="model_not_found",
            )
        if self.worker.load() > self.queue_max:
            self.rejected_total += 1
            retry = max(1, min(60, math.ceil((self.worker.generation_s or 1.0) * (self.worker.waiting + 1))))
            return error(
                429,
                f"the engine's queue is full ({self.queue_max} waiting); retry later",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            )
        events = Events(asyncio.get_running_loop(), eager=req.stream)
        job = Job(req, events)
        self.worker.submit(job)
        watcher = asyncio.ensure_future(watch_disconnect(request.receive, events))

        def close() -> None:
            watcher.cancel()
            if not events.ended:
                self.worker.cancel(job)

        streaming = False
        try:
            first = await events.batch()
            if first is None:
                return Response(status_code=499)
            if first[0][0] == "error":
                _, status, message, code = first[0]
                return error(status, message, code=code)
            _, model, _, trimmed = first[0]
            reply = Reply(model)
            reply.governor["trimmed_messages"] = trimmed
            if not req.stream:
                return await self._collect(events, first[1:], reply)
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            streaming = True  # the response closes from now on
            return EventStream(sse(events, first[1:], reply, include_usage), on_close=close)
        finally:
            if not streaming:
                close()

    async def _collect(self, events: Events, backlog: list[Event], reply: Reply) -> Response:
        parts: list[str] = []
        batch: list[Event] | None = backlog
        while batch is not None:
            for ev in batch:
                kind = ev[0]
                if kind == "text":
                    parts.append(ev[1])
                elif kind == "trim":
                    reply.governor["trimmed_messages"] = ev[1]
                elif kind == "model":
                    reply.set_model(ev[1])
                elif kind == "error":
                    return error(ev[1], ev[2], code=ev[3])
                elif kind == "end":
                    return JSONResponse(reply.full("".join(parts), ev[1], ev[2]))
            batch = await events.batch()
        return Response(status_code=499)


def _settle(fut: asyncio.Future[Any], value: Any, exc: Exception | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
