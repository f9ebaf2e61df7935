"""The engine API's HTTP plumbing: errors in the OpenAI shape (`{"error": {"message", "type", "param", "code"}}`, the
type from the status), and request bodies read within a limit (413 before reading when Content-Length is too large,
while reading when a chunked body grows past it) and parsed, a parse error answered as a 400 naming the field.
governor.engine.app's routes use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


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


T = TypeVar("T")


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


async def parse_body(request: Request, limit: int, parse: Callable[[bytes], T]) -> T | Response:
    """The body read (at most `limit` bytes) and parsed by `parse`, or the 413 / 400 answer that says what was wrong."""
    try:
        return parse(await read_body(request, limit))
    except BodyTooLarge:
        return too_large(limit)
    except ValidationError as exc:
        return validation_error(exc)


def too_large(limit: int) -> JSONResponse:
    return error(413, f"request body larger than {limit} bytes", code="body_too_large")


def validation_error(exc: ValidationError) -> JSONResponse:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return error(400, f"malformed JSON body: {err['msg']}", code="invalid_json")
    where = ".".join(str(p) for p in err["loc"]) or None
    return error(400, f"{where or 'body'}: {err['msg']}", param=where, code=err["type"])
