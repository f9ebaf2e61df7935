"""A hostile upstream: a real local HTTP/1.1 server (TCP, on a thread) that answers each request the way `mode`
says, framing and all, byte for byte -- misbehaving on purpose (not collected: no test_ prefix)."""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Callable
from urllib.parse import quote

KEY = "sk-TEST+KEY/abc="  # every character that URL, JSON and base64 encode differently
CHUNK = {"id": "c", "object": "chat.completion.chunk", "model": "up", "created": 0}
ANSWER = {
    "id": "x",
    "object": "chat.completion",
    "model": "hostile-up",
    "created": 0,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "from upstream"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
}


def _event(delta: dict[str, object], finish: str | None = None) -> bytes:
    data = CHUNK | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


STREAM = _event({"role": "assistant", "content": ""}) + _event({"content": "from upstream"}) + _event({}, "stop")


def _head(status: str, *headers: str) -> bytes:
    return (f"HTTP/1.1 {status}\r\n" + "".join(f"{h}\r\n" for h in headers) + "\r\n").encode()


def _json(body: bytes, status: str = "200 OK") -> bytes:
    return _head(status, "content-type: application/json", f"content-length: {len(body)}") + body


def _sse(body: bytes) -> bytes:
    return _head("200 OK", "content-type: text/event-stream", "connection: close") + body


def _chunked(body: bytes) -> bytes:
    return (
        _head("200 OK", "content-type: application/json", "transfer-encoding: chunked", "trailer: x-checksum")
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\nx-checksum: 42\r\n\r\n"
    )


def _huge_answer(sock: socket.socket) -> None:
    size = 300 * 2**20
    sock.sendall(_head("200 OK", "content-type: application/json", f"content-length: {size}") + b'{"a": "')
    block = b"x" * 2**20
    for _ in range(300):
        sock.sendall(block)


def _huge_header(sock: socket.socket) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\nx-big: ")
    for _ in range(64):
        sock.sendall(b"a" * 2**20)
    sock.sendall(b"\r\ncontent-length: 2\r\n\r\n{}")


def _stalls(sock: socket.socket) -> None:
    sock.recv(1)  # waits for the daemon to give up and close


def _echo(encoded: str) -> Callable[[socket.socket], None]:
    def send(sock: socket.socket) -> None:
        body = json.dumps({"error": {"message": f"invalid key {encoded}", "code": "invalid_api_key"}}).encode()
        sock.sendall(_json(body, "401 Unauthorized"))

    return send


def _bytes(data: bytes) -> Callable[[socket.socket], None]:
    return lambda sock: sock.sendall(data)


def _deep() -> bytes:
    return b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


MODES: dict[str, Callable[[socket.socket], None]] = {
    "json": _bytes(_json(json.dumps(ANSWER).encode())),
    "json close-delimited (no length)": _bytes(
        _head("200 OK", "content-type: application/json", "connection: close") + json.dumps(ANSWER).encode()
    ),
    "json chunked with a trailer": _bytes(_chunked(json.dumps(ANSWER).encode())),
    "100 Continue then json": _bytes(b"HTTP/1.1 100 Continue\r\n\r\n" + _json(json.dumps(ANSWER).encode())),
    "SSE close-delimited ending [DONE]": _bytes(_sse(STREAM + b"data: [DONE]\n\n")),
    "200 {not json at all": _bytes(_json(b"{not json at all")),
    "200 JSON array": _bytes(_json(b"[1, 2, 3]")),
    "200 JSON 100,000 deep": _bytes(_json(_deep())),
    "200 SSE data: {not json": _bytes(_sse(b"data: {not json\n\ndata: [DONE]\n\n")),
    "300 MB answer": _huge_answer,
    "64 MB response header": _huge_header,
    "2 MB of events before a token": _bytes(_sse(_event({"role": "assistant"}) * 20_000)),
    "garbage status line": _bytes(b"HELLO THERE\r\n\r\n"),
    "closes after the head": _bytes(_head("200 OK", "content-type: application/json", "content-length: 100")),
    "invalid chunk size": _bytes(_head("200 OK", "transfer-encoding: chunked") + b"zz\r\nhello\r\n"),
    "negative content-length": _bytes(_head("200 OK", "content-length: -5") + b"{}"),
    "two content-lengths": _bytes(_head("200 OK", "content-length: 2", "content-length: 7") + b"{}"),
    "accepts and never answers": _stalls,
    "401 echoing the key": _echo(KEY),
    "401 echoing the key URL-encoded": _echo(quote(KEY, safe="")),
    "401 echoing the key JSON-escaped": _echo(KEY.replace("/", "\\/")),
    "401 echoing the key in base64": _echo(base64.b64encode(f"Bearer {KEY}".encode()).decode()),
}
GOOD = frozenset(
    {
        "json",
        "json close-delimited (no length)",
        "json chunked with a trailer",
        "100 Continue then json",
        "SSE close-delimited ending [DONE]",
    }
)


class HostileUpstream:
    def __init__(self) -> None:
        self.mode = "json"
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="hostile-upstream", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    data = conn.recv(65536)
                    if not data:
                        return
                    request += data
                head, body = request.split(b"\r\n\r\n", 1)
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")[1:]
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                while len(body) < length and (data := conn.recv(65536)):
                    body += data  # read whole: closing on unread bytes would reset the connection
                self.requests.append(head)
                MODES[self.mode](conn)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
