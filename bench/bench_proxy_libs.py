"""Could a well-kept HTTP library carry the public-socket proxy? Its CPU per relayed chunk, side by side (issue 33).

    .venv/bin/python bench/bench_proxy_libs.py [--chunks 2000] [--interval-ms 1] [--rounds 5]

Needs aiohttp (in the dev extra, which `make setup` installs; not a dependency of the governor). Three proxies run in
this process, each on its own thread and event loop (uvloop when installed, as the daemon's), in front of the same
scripted engine as bench_proxy_chunks.py (one chunked SSE answer of `--chunks` events, one every `--interval-ms`), and
a client child reads each answer through one of them, the variants taking turns round by round:
- ours: the daemon's `ProxyServer` (uvicorn's httptools protocol + proxylink.EngineLink, h11 + httptools);
- uvicorn + aiohttp client: uvicorn's protocol classes serving a raw ASGI app that streams with aiohttp's client
  (`UnixConnector`, `content.iter_any()`);
- aiohttp: aiohttp's own server (`web.StreamResponse`) and client.
The figure is each proxy thread's CPU time (schedstat) ÷ chunks. The engine's own CPU per token is in
docs/benchmarks.md (about 21.6 ms for the demo small tier on 2 threads): the #16 budget is 1 % of it, 216 µs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_proxy import Gate
from bench.bench_proxy_chunks import CLIENT, ENGINE, thread_stat
from governor.daemon.publicsocket import ProxyServer, fast_loop

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


def serve_on_thread(name: str, main: Callable[[], Coroutine[Any, Any, None]]) -> threading.Thread:
    def run() -> None:
        with asyncio.Runner(loop_factory=fast_loop()) as runner:
            runner.run(main())

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def uvicorn_with_aiohttp_client(public: Path, engine: Path) -> threading.Thread:
    import aiohttp
    import uvicorn

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(engine)))

        async def app(scope: Scope, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
            if scope["type"] != "http":
                return
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            async with session.post("http://engine" + scope["path"], data=body) as resp:
                headers = [(k.lower().encode(), v.encode()) for k, v in resp.headers.items()]
                headers = [(k, v) for k, v in headers if k not in (b"transfer-encoding", b"content-length")]
                await send({"type": "http.response.start", "status": resp.status, "headers": headers})
                async for data in resp.content.iter_any():
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        config = uvicorn.Config(app, uds=str(public), log_config=None, log_level="warning", lifespan="off")
        await uvicorn.Server(config).serve()

    return serve_on_thread("proxy-uvicorn-aiohttp", main)


def aiohttp_server_and_client(public: Path, engine: Path) -> threading.Thread:
    import aiohttp
    from aiohttp import web

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(engine)))

        async def relay(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with session.post("http://engine" + request.path, data=body) as resp:
                out = web.StreamResponse(status=resp.status)
                out.content_type = resp.content_type
                await out.prepare(request)
                async for data in resp.content.iter_any():
                    await out.write(data)
                await out.write_eof()
                return out

        app = web.Application()
        app.router.add_post("/v1/chat/completions", relay)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(public)).start()
        await asyncio.Event().wait()

    return serve_on_thread("proxy-aiohttp", main)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--interval-ms", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("bench_proxy_libs: aiohttp is not installed (pip install aiohttp): skipped")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="gvpl", dir="/tmp"))
    engine_sock = tmp / "engine.sock"
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(engine_sock), str(args.chunks), str(args.interval_ms / 1000)]
    )
    ours = ProxyServer(tmp / "ours.sock", engine_sock, Gate(ready=True), hold_s=5.0, drain_s=1)
    ours.start()
    threads = {
        "ours (uvicorn + EngineLink)": (tmp / "ours.sock", ours._thread),
        "uvicorn + aiohttp client": (tmp / "uva.sock", uvicorn_with_aiohttp_client(tmp / "uva.sock", engine_sock)),
        "aiohttp server + client": (tmp / "aio.sock", aiohttp_server_and_client(tmp / "aio.sock", engine_sock)),
    }
    try:
        deadline = time.monotonic() + 20
        while not all(path.exists() for path, _ in threads.values()) or not engine_sock.exists():
            if time.monotonic() > deadline:
                raise SystemExit("a proxy did not start")
            time.sleep(0.05)
        results: dict[str, list[float]] = {name: [] for name in threads}
        for round_ in range(args.rounds + 1):  # the first round warms up (imports, first connections)
            for name, (path, thread) in threads.items():
                assert thread.native_id is not None
                ns0 = thread_stat(thread.native_id)[0]
                out = subprocess.run([sys.executable, "-c", CLIENT, str(path)], check=True, capture_output=True)
                ns1 = thread_stat(thread.native_id)[0]
                assert int(out.stdout) == args.chunks, (name, out.stdout)
                if round_:
                    results[name].append((ns1 - ns0) / 1e3 / args.chunks)
        base = statistics.median(results["ours (uvicorn + EngineLink)"])
        print(f"{args.chunks} chunks a round, one every {args.interval_ms} ms, {args.rounds} rounds each, interleaved")
        for name, per_chunk in results.items():
            median = statistics.median(per_chunk)
            print(
                f"{name:32} proxy thread CPU per chunk: median {median:6.1f} µs ({median / base:.2f}x ours); "
                f"rounds {', '.join(f'{x:.1f}' for x in per_chunk)}"
            )
        print(f"load {os.getloadavg()[0]:.1f}")
    finally:
        ours.close(5.0)
        engine.kill()
        engine.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
