"""The composition root: `build(config)` makes every part of the daemon and passes each one in.

sensors (SensorSampler under --root) -> policy StateMachine (with the ladder's memory footprints) wrapped by the
supervisor's word -> the supervised engine child, through its driver; plus holds, the control socket, udev events,
sd_notify, metrics and the recorder feed. Time is injected: the lab runs the same GovernorLoop on a VirtualClock.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from govbase.errors import GovernorError
from governor.actuator import Actuator
from governor.clock import Clock, RealClock, Wake
from governor.daemon.affinity import Affinity
from governor.daemon.config import DaemonConfig
from governor.daemon.desired import DesiredEngine
from governor.daemon.engine import SupervisedDecider, SupervisedEngine
from governor.daemon.external import External, ExternalSupervisor
from governor.daemon.freqcap import FreqCap
from governor.daemon.holds import HoldRegistry
from governor.daemon.llamacpp import LlamaCppPython
from governor.daemon.llamaserver import LlamaServer
from governor.daemon.metrics import DaemonMetrics
from governor.daemon.notify import Notifier
from governor.daemon.polled import NoticingGate
from governor.daemon.runtime import Daemon
from governor.daemon.state import DaemonState
from governor.daemon.supervisor import EngineSupervisor
from governor.daemon.watch import EngineWatch
from governor.engine.client import EngineError, EngineStatus, EngineUnavailable
from governor.loop import Decider, GovernorLoop
from governor.programs import NO_LLAMA_CPP, find_program
from governor.unixsock import check_private_dir
from policies.ladder import ModelLadder, load_ladder
from policies.schema import EngineOptions
from sensors.events import UdevEvent, UdevEvents
from sensors.root import Root
from sensors.sampler import make_sampler

if TYPE_CHECKING:
    from governor.daemon.routing import Router
    from policies.schema import Policy


def ladder_path(config: DaemonConfig) -> Path:
    """The configured ladder, else the demo ladder in the state directory (written on first use)."""
    if config.models is not None:
        return config.models
    directory = config.state_dir / "demo-models"
    structlog.get_logger("governor.daemon").info("using the demo models (SmolLM2-135M-Instruct)", dir=str(directory))
    # A child writes them (only when missing or stale), so gguf and numpy never load into the daemon.
    argv = [sys.executable, "-m", "governor", "demo-models", "--dir", str(directory)]
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise GovernorError(f"cannot write the demo models: {lines[-1] if lines else done.returncode}")
    return directory / "ladder.toml"


def policy_loader(
    ladder: ModelLadder,
    ladder_file: Path,
    freq_ratios: tuple[float, ...] | None = None,
    device_model: Path | None = None,
) -> Callable[[str], Decider]:
    """name or file -> the policy core, with each tier's memory footprint read once from its GGUF header and the
    CPU clock caps the frequency actuator can write (None: threads and rate are the only actuators)."""
    from governor.daemon.footprints import read_footprints
    from policies import StateMachine, load_policy

    footprints = read_footprints(ladder_file)

    def load(name: str) -> Decider:
        prior = None
        if device_model is not None:  # read at every (re)load: a new bench-device run is picked up by a reload
            from policies.devicefile import load_device_model

            prior = load_device_model(device_model)
        policy = load_policy(name)
        return StateMachine(policy, ladder=ladder, footprints=footprints, freq_ratios=freq_ratios, prior=prior)

    return load


def engine_options(decider: Decider) -> EngineOptions:
    """The policy's `[engine]` table (for a Decider that is not a policy core: the defaults)."""
    from policies import StateMachine

    return decider.policy.engine if isinstance(decider, StateMachine) else EngineOptions()


def uevent_handler(sensors: object, wake: Wake | threading.Event) -> Callable[[UdevEvent], None]:
    """A charger plugged or a zone crossing a trip: tick now. Called on pyudev's thread, so it only sets flags."""

    def on_uevent(event: UdevEvent) -> None:
        if event.action in ("add", "remove"):
            invalidate = getattr(sensors, "invalidate", None)  # a supply or zone came or went: rediscover
            if invalidate is not None:
                invalidate()
        if event.subsystem == "power_supply":  # e.g. the charger pulled: read the supplies now, not the last reading
            changed = getattr(sensors, "supply_changed", None)
            if changed is not None:
                changed()
        wake.set()

    return on_uevent


def make_router(
    config: DaemonConfig, env: Mapping[str, str], decider: SupervisedDecider, watch: EngineWatch, metrics: DaemonMetrics
) -> Router:
    """Routing to the config's upstreams, judged against the policy in force and the engine's pushed status."""
    from governor.daemon.routing import build_router

    def policy() -> Policy | None:
        from policies import StateMachine

        inner = decider.inner
        return inner.policy if isinstance(inner, StateMachine) else None

    def engine_status() -> dict[str, Any] | None:
        status = watch.status
        return None if status is None else status.model_dump()

    return build_router(config.upstream, env, policy=policy, engine_status=engine_status, metrics=metrics)


Driver = LlamaCppPython | LlamaServer | External


def make_driver(
    config: DaemonConfig,
    ladder: ModelLadder,
    ladder_file: Path,
    *,
    options: Callable[[], EngineOptions],
    pid: Callable[[], int | None],
) -> Driver:
    """The config's engine (docs/engines.md): its absence is a one-line error at start, not a crash loop."""
    if config.engine == "external":
        assert config.engine_url is not None  # the config's validator
        return External(config.engine_url, models=config.engine_models, options=options)
    if config.engine == "llama-server":
        slots = config.state_dir / "llama-server-slots"  # the conversation across restarts: the daemon's alone
        slots.mkdir(mode=0o700, exist_ok=True)
        program = find_program("llama-server", config.llama_server)
        return LlamaServer(program, ladder, config.engine_child_socket, slots, options=options, pid=pid)
    if importlib.util.find_spec("llama_cpp") is None:
        raise GovernorError(NO_LLAMA_CPP)
    return LlamaCppPython(ladder_file, config.engine_child_socket, drain_s=config.drain_timeout_s, options=options)


def answering(driver: Driver, timeout_s: float) -> EngineStatus | None:
    """The status of the engine answering on the driver's socket, once one answers within `timeout_s` (None: none
    does)."""
    try:
        return driver.wait_ready(timeout_s)
    except EngineError as exc:  # unreachable, or an answer that is not the engine's (e.g. llama-server's /slots)
        if not isinstance(exc, EngineUnavailable):
            structlog.get_logger("governor.daemon").warning("engine answered wrongly", error=str(exc))
        return None


def fresh_status(watch: EngineWatch, timeout_s: float) -> EngineStatus | None:
    """The engine's latest pushed status, if it came within a heartbeat (+ `timeout_s`): the status stream is the
    liveness signal, no round trip (the engine writes at least every probe interval; silent: hung or stopped)."""
    return watch.fresh((watch.heartbeat_s or 0.0) + timeout_s)


def build(config: DaemonConfig, *, clock: Clock | None = None, env: Mapping[str, str] | None = None) -> Daemon:
    clock = clock if clock is not None else RealClock()
    env = os.environ if env is None else env
    for directory in (config.state_dir, config.control_socket.parent, config.engine_socket.parent):
        try:
            directory.mkdir(mode=0o755, parents=True, exist_ok=True)  # never group/other-writable
        except OSError as exc:
            raise GovernorError(f"{directory}: cannot create: {exc.strerror} (set it in the config file)") from exc
    for directory in {config.control_socket.parent, config.engine_socket.parent}:
        check_private_dir(directory, GovernorError)
    if config.engine_socket.exists() and not stat.S_ISSOCK(config.engine_socket.stat().st_mode):
        # The engine would refuse it and die at every start: say so now, in one line, instead of a crash loop.
        raise GovernorError(f"{config.engine_socket}: exists and is not a socket; the engine cannot listen there")
    lpath = ladder_path(config)
    ladder = load_ladder(lpath)
    freq = FreqCap(Root(config.root), config.state_dir)
    freq.start()  # first of all: put back the limits a crashed run left
    load_decider = policy_loader(ladder, lpath, freq.ratios(), config.device_model)
    inner = load_decider(config.policy)  # a bad policy at start is an error; on reload the last good one is kept

    state = DaemonState()
    # The engine's driver: the daemon's own link skips the proxy; the policy in force when the engine (re)starts.
    driver = make_driver(
        config, ladder, lpath, options=lambda: engine_options(decider.inner), pid=lambda: supervisor.pid
    )
    wake = Wake()  # the loop's: the supervisor, the engine's news, holds and udev events tick it now
    # The engine pushes its status (a request arriving wakes the loop) and a heartbeat line every probe interval.
    watch = EngineWatch(driver, on_change=wake.set, heartbeat_s=max(0.1, config.restart.probe_interval_s))
    desired = DesiredEngine(driver)  # the one owner of the engine's settings; its thread posts them
    holds = HoldRegistry(on_change=wake.set)

    def engine_changed() -> None:
        watch.kick()  # a new engine is ready (or the old one gone): (re)connect to its status stream now
        wake.set()

    supervise: Callable[..., EngineSupervisor] = (
        functools.partial(ExternalSupervisor, driver)  # ready while it answers; nothing to start
        if isinstance(driver, External)
        else functools.partial(EngineSupervisor, command=driver.command)
    )
    supervisor = supervise(
        ready=functools.partial(answering, driver),
        desired=desired,
        ladder=ladder,
        restart=config.restart,
        clock=clock,
        latest_snapshot=lambda: state.snapshot,
        on_change=engine_changed,
        probe=functools.partial(fresh_status, watch),
    )
    # The engine child's own CPU time is not "another process" (policies/contention.py).
    sensors = make_sampler(
        config.root, environ=env, engine_pid=lambda: supervisor.pid, slow_max_age_s=1.0, own_caps=freq.own_caps
    )
    decider = SupervisedDecider(inner, supervisor)
    engine = SupervisedEngine(driver, supervisor, desired, watch)
    actuators: list[Actuator] = [
        engine,
        freq,
        Affinity(lambda: None if isinstance(driver, External) else supervisor.pid),  # External pins its own
    ]  # applied in this order after each decision; restored in the reverse order
    loop = GovernorLoop(sensors, decider, engine, clock, actuators=actuators, wake=wake, holds=holds.in_force)

    events = UdevEvents(uevent_handler(sensors, loop.wake)) if config.udev else None
    metrics = DaemonMetrics(
        textfile=config.metrics_textfile,
        extra=lambda: {
            "engine_starts": float(supervisor.status.starts),
            "engine_failures": float(supervisor.status.failures),
            "engine_given_up": float(supervisor.status.critical is not None),
            "holds": float(len(holds.all())),
        },
    )
    from governor.daemon.publicsocket import ProxyServer  # uvicorn and h11 load here, once the config is known good

    router = make_router(config, env, decider, watch, metrics)
    proxy = ProxyServer(
        config.engine_socket,
        driver.address if isinstance(driver, External) else config.engine_child_socket,
        supervisor if isinstance(driver, LlamaCppPython) else NoticingGate(supervisor, driver.on_chat),
        hold_s=config.request_hold_s,
        drain_s=math.ceil(config.drain_timeout_s + config.stop_timeout_s),
        group=config.group,
        router=router,
        pace=None if isinstance(driver, LlamaCppPython) else driver.pace,
        rewrite=driver.rewrite if isinstance(driver, External) else None,
    )
    return Daemon(
        config=config,
        clock=clock,
        loop=loop,
        decider=decider,
        load_decider=load_decider,
        supervisor=supervisor,
        engine=engine,
        proxy=proxy,
        holds=holds,
        state=state,
        metrics=metrics,
        notifier=Notifier(env),
        events=events,
        closeables=(watch, driver, sensors),
        router=router,
    )
