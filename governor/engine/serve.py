"""`governor engine`: load the model, then serve the API on a Unix socket (and loopback TCP only when asked).

The model is loaded before the socket exists, so "GET /engine/status answers" means ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import grp
import importlib.util
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, get_args

import structlog
import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette

from govbase.errors import GovernorError
from governor import logs, unixsock
from governor.engine import fault
from governor.engine.adapters import inspect_all
from governor.engine.adapterspec import AdapterSpec
from governor.engine.config import (
    ConfigRefused,
    ModelSpec,
    check_kv,
    default_threads,
    models_from_ladder,
    single_model,
)
from governor.engine.window import ContextShift
from governor.programs import NO_LLAMA_CPP
from policies.decision import KNOBS, THREADS_MAX, EngineConfig, flag_of
from policies.ladder import ExtraBuffersMode
from sensors.root import Root

if TYPE_CHECKING:
    from governor.engine.feed import StatusFeed
    from governor.engine.worker import Worker

log = structlog.get_logger("governor.engine")


class EngineError(GovernorError):
    pass


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_engine(sub).set_defaults(func=_run_from_cli)


def add_engine(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "engine",
        help="serve a llama.cpp model over an OpenAI-compatible API on a Unix socket",
        description="Serve a GGUF model (or a model ladder) over an OpenAI-compatible HTTP API on a Unix socket, "
        "with a control API (GET /engine/status, POST /engine/config) that changes threads, rate cap, context, "
        "KV-cache type and model while answers stream.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a GGUF file")
    src.add_argument("--models", type=Path, metavar="LADDER.toml", help="a model ladder (policies.ladder)")
    p.add_argument("--tier", help="the ladder tier to start with (default: the first, largest)")
    p.add_argument("--socket", type=Path, required=True, help="the Unix socket path to serve on")
    p.add_argument("--socket-mode", choices=["0600", "0660"], default="0600", help="socket permissions")
    p.add_argument("--socket-group", help="give the socket to this group (with --socket-mode 0660)")
    p.add_argument("--port", type=int, help="also serve on 127.0.0.1:PORT")
    for name, knob in KNOBS.items():  # the settings' flags: --threads, --ctx, --kv, --max-tokens-per-s, ...
        if flag_of(name):
            p.add_argument(flag_of(name), dest=name, metavar="VALUE", help=knob.help)
    p.add_argument("--queue", type=int, default=8, help="requests that may wait behind the running one (default 8)")
    p.add_argument("--drain-s", type=float, default=10.0, help="on SIGTERM, time running answers get to finish")
    p.add_argument(
        "--slow-callback-ms",
        type=float,
        metavar="MS",
        help="asyncio debug mode: log every event-loop step that takes longer than MS as engine.slow_callback "
        "(for tests and diagnosis; debug mode slows the loop down)",
    )
    p.add_argument(
        "--keep-alive",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="unload the model after this long without requests; the next request loads it again "
        "(0 = never; default 300, as Ollama)",
    )
    p.add_argument(
        "--load-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long a request may wait on a model load before it gets 503 with Retry-After (default 60)",
    )
    p.add_argument(
        "--extra-buffers",
        choices=get_args(ExtraBuffersMode),
        help="llama.cpp's extra weight buffers (AMX, repack): auto = off only where the CPU reports AMX, whose "
        "llama.cpp path crashes (default: the ladder's extra_buffers, else auto)",
    )
    p.add_argument(
        "--context-shift",
        choices=get_args(ContextShift),
        default="on",
        help="a chat that outgrows the context: on = drop old turns in large chunks and move the kept part in the KV "
        "cache (re-evaluate where the model cannot shift); reevaluate = the same chunks, re-evaluated; off = drop as "
        "few turns as possible and re-evaluate every turn (the behaviour before issue 11) (default on)",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        metavar="MS",
        help="a streamed answer's text leaves at most every MS milliseconds, several tokens a chunk (the first at "
        "once; 0 = every token as it comes). Default auto: 100 when the decode threads take every CPU (the client's "
        "work per chunk would take a core they need), else 0",
    )
    p.add_argument("--root", type=Path, default=Path("/"), metavar="DIR", help="read DIR/proc/cpuinfo (default /)")
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop (as on SIGTERM) when the process that started this one is gone: the governor daemon passes it, "
        "so an engine does not outlive a daemon that was killed (its memory and socket held, next to the next one's)",
    )
    return p


def exit_with_parent(interval_s: float = 0.5) -> threading.Thread:
    """A thread that sends this process SIGTERM once its parent has gone (it was re-parented: getppid changed)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        log.warning("engine.orphaned", parent=parent, why="the process that started it is gone: stopping as on SIGTERM")
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def _run_from_cli(args: argparse.Namespace) -> int:
    launched = Path(sys.argv[0]).name in ("governor", "__main__.py") and "engine" in sys.argv[1:]
    if launched and not os.environ.get("GOVERNOR_NO_REEXEC"):
        # The full CLI has imported every subcommand's modules (gguf, yaml, the lab, the daemon's CLI: about 3 MB of
        # live Python objects) that an engine would keep through every idle unload (issue 14: RSS unloaded ÷ bare
        # engine): become the lean entry point instead (same pid, as `governor run` does).
        os.execv(sys.executable, [sys.executable, "-m", "governor.engine", *sys.argv[1:]])
    return run(args)


def initial(args: argparse.Namespace) -> tuple[dict[str, ModelSpec], EngineConfig]:
    if args.models is not None:
        from policies.ladder import load_ladder

        models = models_from_ladder(load_ladder(args.models))
        name = args.tier or next(iter(models))
        if name not in models:
            raise EngineError(f"--tier {name!r}: not in {args.models} (tiers: {list(models)})")
    else:
        if args.tier is not None:
            raise EngineError("--tier needs --models LADDER.toml")
        if not args.model.is_file():
            raise EngineError(f"--model {args.model}: no such file")
        models = single_model(args.model, 2048)
        name = next(iter(models))
    spec = models[name]
    settings = EngineConfig(
        model=name, threads=min(default_threads(), THREADS_MAX), n_ctx=spec.default_ctx, kv_type=spec.default_kv
    )
    given = {k: v for k in KNOBS if flag_of(k) and (v := getattr(args, k)) is not None}
    try:
        settings = settings.change(given, strict=False)  # command-line text: "4" is 4 here
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = str(err["loc"][0])
        raise EngineError(f"{flag_of(field)} {given[field]}: {err['msg']}") from exc
    if args.models is None:
        models = single_model(args.model, settings.n_ctx)
    elif spec.max_ctx is not None and settings.n_ctx > spec.max_ctx:
        raise EngineError(f"{flag_of('n_ctx')} {settings.n_ctx}: tier {name!r} allows at most {spec.max_ctx}")
    try:
        check_kv(spec, settings.kv_type)
    except ConfigRefused as exc:
        raise EngineError(f"{flag_of('kv_type')} {settings.kv_type}: {exc.message}") from exc
    if args.queue < 0:
        raise EngineError(f"--queue {args.queue}: must be >= 0")
    if args.slow_callback_ms is not None and not 0 < args.slow_callback_ms <= 60_000:
        raise EngineError(f"--slow-callback-ms {args.slow_callback_ms}: must be > 0 and at most 60000")
    if args.stream_interval_ms is not None and not 0 <= args.stream_interval_ms <= 10_000:
        raise EngineError(f"--stream-interval-ms {args.stream_interval_ms}: must be between 0 and 10000")
    for flag, value in (("--keep-alive", args.keep_alive), ("--load-wait", args.load_wait)):
        if not (0 <= value <= 1e7):  # also refuses nan and inf
            raise EngineError(f"{flag} {value}: must be between 0 and 10000000 seconds")
    return models, settings


def adapters(args: argparse.Namespace) -> dict[str, AdapterSpec]:
    """The ladder's LoRA adapters, their files checked (a bad one is logged and refused to requests, not fatal)."""
    if args.models is None:
        return {}
    from policies.ladder import load_ladder

    return inspect_all(load_ladder(args.models).adapters)


def extra_buffers_mode(args: argparse.Namespace) -> ExtraBuffersMode:
    """The flag, else the ladder's `extra_buffers`, else auto (decided against the CPU once llama.cpp is loaded)."""
    if args.extra_buffers is not None:
        mode: ExtraBuffersMode = args.extra_buffers
        return mode
    if args.models is not None:
        from policies.ladder import load_ladder

        return load_ladder(args.models).extra_buffers
    return "auto"


def bind_unix(path: Path, mode: int, group: str | None = None) -> socket.socket:
    """Bound with its final mode (and group) from the first instant; a leftover socket nobody answers on is replaced."""
    try:
        gid = grp.getgrnam(group).gr_gid if group else -1
    except KeyError:
        raise EngineError(f"--socket-group {group!r}: no such group") from None
    return unixsock.bind_unix(path, mode, lambda reason: EngineError(f"--socket {path}: {reason}"), gid=gid)


def bind_tcp(port: int) -> socket.socket:
    try:
        return socket.create_server(("127.0.0.1", port))
    except OSError as exc:
        raise EngineError(f"--port {port}: cannot bind 127.0.0.1:{port}: {exc.strerror}") from exc


class _Server(uvicorn.Server):
    """uvicorn's phased shutdown (stop accepting, wait for responses, lifespan shutdown), plus: after `drain_s`
    the running answer is ended at a token boundary, so its client still gets a complete response; open status
    streams end first. And an idle engine sleeps: uvicorn's main loop wakes every 0.1 s to look for a stop request
    (ten wake-ups a second, for nothing); this one sleeps until a signal arrives."""

    def __init__(self, config: uvicorn.Config, worker: Worker, feed: StatusFeed, drain_s: float) -> None:
        super().__init__(config)
        self._worker = worker
        self._feed = feed
        self._drain_s = drain_s
        self._exit: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._exit = asyncio.Event()
        if threading.current_thread() is threading.main_thread():
            # A handler the loop knows of: the signal wakes its selector. uvicorn's plain signal.signal handler
            # runs only when the main thread runs Python, which an idle loop no longer does.
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, self.handle_exit, signum, None)
        if await self.on_tick(0):  # the default headers, once (config has date_header=False: it would go stale)
            return
        await self._exit.wait()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # a second Ctrl-C or SIGTERM: no more draining, the running answer ends at its next token
            log.warning("engine.stopping_now")
            self._worker.end_answers()
        super().handle_exit(sig, frame)
        if self._exit is not None:
            self._exit.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info("engine.stopping", drain_s=self._drain_s, busy=self._worker.busy)
        self._feed.close()
        handle = asyncio.get_running_loop().call_later(self._drain_s, self._worker.end_answers)
        try:
            await super().shutdown(sockets)
        finally:
            handle.cancel()


def run(args: argparse.Namespace) -> int:
    if args.exit_with_parent:
        exit_with_parent()
    # Arguments first: a bad one is an error before llama.cpp is even imported.
    models, settings = initial(args)
    mode = extra_buffers_mode(args)
    if importlib.util.find_spec("llama_cpp") is None:
        raise EngineError(NO_LLAMA_CPP)
    from governor.engine import loopwatch
    from governor.engine.app import EngineApp
    from governor.engine.model import ModelLoadError, extra_buffers_for
    from governor.engine.worker import Worker

    buffers = extra_buffers_for(mode, Root(args.root))

    logs.keep_own_stderr()
    # Everything imported so far lives as long as the process: keep the cyclic garbage collector from walking it
    # (some 80,000 objects: a full collection took 0.2 s, holding the GIL and so the event loop, at every reload).
    gc.collect()
    gc.freeze()
    log.info("engine.extra_buffers", **buffers.as_dict())
    try:
        worker = Worker(
            models,
            settings,
            buffers,
            keep_alive_s=args.keep_alive or None,
            context_shift=args.context_shift,
            adapters=adapters(args),
        )
    except ModelLoadError as exc:
        raise EngineError(str(exc)) from exc
    log.info(
        "engine.loaded",
        **settings.model_dump(),
        path=str(models[settings.model].path),
        weight_buffers_mib=worker.slot.weight_buffers_mib,
    )
    fault.maybe_crash("load", settings.model)
    engine = EngineApp(
        worker, queue_max=args.queue, load_wait_s=args.load_wait, stream_interval_ms=args.stream_interval_ms
    )
    sockets = [bind_unix(args.socket, int(args.socket_mode, 8), args.socket_group)]
    inode = os.stat(args.socket).st_ino
    try:
        if args.port is not None:
            sockets.append(bind_tcp(args.port))

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            if args.slow_callback_ms is not None:
                loopwatch.watch(asyncio.get_running_loop(), args.slow_callback_ms / 1000)
            worker.start()
            await asyncio.to_thread(worker.warm.wait)  # serve once the first decode ran (a crash there: a load crash)
            log.info("engine.serving", socket=str(args.socket), port=args.port, pid=os.getpid())
            yield
            # uvicorn has stopped accepting and waited up to --drain-s for running answers.
            await asyncio.to_thread(worker.stop)
            log.info("engine.stopped", **vars(worker.counters))

        engine.app.router.lifespan_context = lifespan
        config = uvicorn.Config(
            engine.app,
            log_config=None,
            log_level="warning",
            access_log=False,
            date_header=False,
            lifespan="on",
            loop="auto" if args.slow_callback_ms is None else "governor.engine.loopwatch:WatchedLoop",
            timeout_graceful_shutdown=args.drain_s + 5.0,  # a backstop: answers end by themselves after drain_s
        )
        # uvicorn re-raises a caught SIGTERM after shutdown; a no-op handler makes that a clean exit 0.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        _Server(config, worker, engine.feed, args.drain_s).run(sockets=sockets)
    finally:
        for s in sockets:
            s.close()
        with contextlib.suppress(OSError):
            if os.stat(args.socket).st_ino == inode:
                args.socket.unlink()
    return 0
