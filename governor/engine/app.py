"""The HTTP side: an OpenAI-compatible chat API and the engine's control API, on the event loop.

Per token the loop does little: the worker appends events to a deque and wakes the loop at most once per batch;
one SSE write carries every token that arrived since the last one. Requests are validated once (pydantic,
strict), never per token.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import psutil
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from governor.engine.chat import ChatRequest
from governor.engine.config import Applied, ConfigChange, ConfigRefused, Settings, resolve
from governor.engine.jobs import ConfigJob, Job
from governor.engine.worker import Worker


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


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


def validation_error(exc: ValidationError) -> JSONResponse:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return error(400, f"malformed JSON body: {err['msg']}", code="invalid_json")
    where = ".".join(str(p) for p in err["loc"]) or None
    return error(400, f"{where or 'body'}: {err['msg']}", param=where, code=err["type"])


class _Events:
    """Worker → loop hand-off for one generation: a deque plus at most one pending wake-up of the loop.

    Not `eager` (a non-streamed answer): text does not wake the loop at all, only the other events do.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, eager: bool) -> None:
        self._loop = loop
        self._eager = eager
        self._items: deque[tuple[Any, ...]] = deque()
        self._ready = asyncio.Event()
        self._scheduled = False

    def __call__(self, event: tuple[Any, ...]) -> None:  # on the worker thread
        self._items.append(event)
        if not self._eager and event[0] == "text":
            return
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._scheduled = False
        self._ready.set()

    async def batch(self) -> list[tuple[Any, ...]]:
        while not self._items:
            await self._ready.wait()
            self._ready.clear()
        out = list(self._items)
        for _ in out:
            self._items.popleft()
        return out


async def _disconnected(receive: Receive) -> None:
    """Returns when the client goes away (uvicorn answers `receive()` with http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Reply:
    """Builds the OpenAI response objects; chunk JSON is assembled from pre-encoded parts."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.governor: dict[str, Any] = {"trimmed_messages": 0}
        self.set_model(model)

    def set_model(self, model: str) -> None:
        self.model = model
        self._head = _dumps(
            {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": model}
        )[:-1]

    def chunk(self, delta: dict[str, str], finish: str | None = None, usage: dict[str, int] | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        extra = f',"usage":{_dumps(usage)}' if usage is not None else ""
        if self.governor["trimmed_messages"]:
            extra += f',"governor":{_dumps(self.governor)}'
        return f'data: {self._head},"choices":[{_dumps(choice)}]{extra}}}\n\n'

    def usage_chunk(self, usage: dict[str, int]) -> str:
        return f'data: {self._head},"choices":[],"usage":{_dumps(usage)}}}\n\n'

    def full(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
            "governor": self.governor,
        }


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
            change = ConfigChange.model_validate_json(await request.body())
            resolve(self.worker.settings, change, self.worker.models)  # refuse now, before touching the model
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
            req = ChatRequest.model_validate_json(await request.body())
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
        events = _Events(asyncio.get_running_loop(), eager=req.stream)
        job = Job(req, events)
        self.worker.submit(job)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            first = await _first_or_gone(events.batch(), gone)
        finally:
            gone.cancel()
        if first is None:
            self.worker.cancel(job)
            return Response(status_code=499)
        if first[0][0] == "error":
            _, status, message, code = first[0]
            return error(status, message, code=code)
        _, model, _, trimmed = first[0]
        reply = _Reply(model)
        reply.governor["trimmed_messages"] = trimmed
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(
                self._sse(job, events, first[1:], reply, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._collect(job, events, first[1:], reply, request.receive)

    async def _collect(
        self, job: Job, events: _Events, backlog: list[tuple[Any, ...]], reply: _Reply, receive: Receive
    ) -> Response:
        parts: list[str] = []
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            while True:
                for ev in backlog:
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
                got = await _first_or_gone(events.batch(), gone)
                if got is None:
                    self.worker.cancel(job)
                    return Response(status_code=499)
                backlog = got
        finally:
            gone.cancel()

    async def _sse(
        self, job: Job, events: _Events, backlog: list[tuple[Any, ...]], reply: _Reply, include_usage: bool
    ) -> AsyncIterator[str]:
        finished = False
        try:
            yield reply.chunk({"role": "assistant", "content": ""})
            while True:
                out: list[str] = []
                text: list[str] = []
                for ev in backlog:
                    kind = ev[0]
                    if kind == "text":
                        text.append(ev[1])
                        continue
                    if text:
                        out.append(reply.chunk({"content": "".join(text)}))
                        text = []
                    if kind == "trim":
                        reply.governor["trimmed_messages"] = ev[1]
                    elif kind == "model":
                        reply.set_model(ev[1])
                    elif kind == "error":
                        err = {"error": {"message": ev[2], "type": "server_error", "param": None, "code": ev[3]}}
                        out.append(f"data: {_dumps(err)}\n\n")
                        finished = True
                    elif kind == "end":
                        out.append(reply.chunk({}, ev[1], ev[2]))
                        if include_usage:
                            out.append(reply.usage_chunk(ev[2]))
                        finished = True
                if text:
                    out.append(reply.chunk({"content": "".join(text)}))
                if out:
                    yield "".join(out)
                if finished:
                    yield "data: [DONE]\n\n"
                    return
                backlog = await events.batch()
        finally:
            if not finished:
                self.worker.cancel(job)


async def _first_or_gone(
    batch: Awaitable[list[tuple[Any, ...]]], gone: asyncio.Future[None]
) -> list[tuple[Any, ...]] | None:
    """The next events, or None when the client disconnected first."""
    task = asyncio.ensure_future(batch)
    waiters: set[asyncio.Future[Any]] = {task, gone}
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    return None


def _settle(fut: asyncio.Future[Any], value: Any, exc: Exception | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
