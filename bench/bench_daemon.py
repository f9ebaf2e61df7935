"""The daemon's own cost: CPU per loop tick and RSS without the engine (goals: < 2 ms per tick, < 60 MB).

Per tick, with the real parts: SensorSampler on a fake laptop tree (2 zones, a hwmon chip, battery + mains, 4 CPUs,
meminfo, PSI), the real policy StateMachine (default policy, the demo ladder's footprints) wrapped by the supervisor's
decider, the daemon's listeners (status/why state, Prometheus metrics, sd_notify off) and a real engine process (the
demo ladder's small tier) observed as the daemon observes it: the status it pushes on `GET /engine/events`, read by
an EngineWatch. Beside it, the same tick observing by a `GET /engine/status` round trip per tick (what the daemon did
before). CPU is `time.process_time()` over N ticks (this process only: the engine's side of a poll is not in it;
bench_footprint.py counts both processes). Its parts are timed side by side in the same run.
RSS: `governor run` as a real process on the same tree with the demo ladder, the engine child excluded, once ready.
The machine is shared (2 cores, several engineers at work): figures are noisy; the median of 5 rounds is printed.
Usage: .venv/bin/python bench/bench_daemon.py [--ticks N]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the fake-tree builder lives in tests/

import psutil

from governor import logs
from governor.clock import RealClock
from governor.daemon.client import ControlClient
from governor.daemon.desired import DesiredEngine
from governor.daemon.engine import SupervisedDecider
from governor.daemon.llamacpp import LlamaCppPython
from governor.daemon.metrics import DaemonMetrics
from governor.daemon.restarts import RestartPolicy
from governor.daemon.state import DaemonState
from governor.daemon.supervisor import EngineSupervisor
from governor.daemon.watch import EngineWatch
from governor.demo.models import RANDOM_DIR, write_demo_models
from governor.engine.client import EngineClient
from governor.loop import GovernorLoop
from policies import StateMachine, load_policy
from policies.assemble import load_footprints
from policies.ladder import load_ladder
from sensors.sampler import SensorSampler
from sensors.snapshot import EngineObservation
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

TICK_GOAL_MS = 2.0
RSS_GOAL_MB = 60.0
REPO = Path(__file__).resolve().parent.parent


class WatchedEngine:
    """The daemon's view of the engine without the supervisor: observe = the last pushed status, no I/O."""

    def __init__(self, watch: EngineWatch) -> None:
        self.watch = watch

    def observe(self) -> EngineObservation | None:
        return self.watch.latest


class PolledEngine(WatchedEngine):
    """The old way: a `GET /engine/status` round trip with JSON every tick."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def observe(self) -> EngineObservation | None:
        return self.client.observe()


@contextlib.contextmanager
def engine_process(ladder_path: Path, work: Path) -> Iterator[EngineClient]:
    sock = work / "engine.sock"
    argv = [sys.executable, "-m", "governor", "engine", "--models", str(ladder_path), "--tier", "small",
            "--threads", "1", "--socket", str(sock)]  # fmt: skip
    with (work / "engine.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    client = EngineClient(sock, timeout_s=10.0)
    try:
        client.wait_ready(120, process=proc)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)


def cpu_ms(func: Callable[[], object], n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        func()
    return (time.process_time() - start) * 1000 / n


def per_tick(root: Path, ladder_path: Path, ticks: int, client: EngineClient) -> dict[str, float]:
    ladder = load_ladder(ladder_path)
    footprints = load_footprints(ladder)
    policy = StateMachine(load_policy("default"), ladder=ladder, footprints=footprints)
    supervisor = EngineSupervisor(
        command=lambda _cfg, _eb: [],
        ready=lambda _t: None,
        desired=DesiredEngine(LlamaCppPython(ladder_path, client.socket_path)),
        ladder=ladder,
        restart=RestartPolicy(),
        clock=RealClock(),
    )  # never started: only its decider wrapper is on the path of a tick
    sampler = SensorSampler(root, cpu_util=None)
    state, metrics = DaemonState(), DaemonMetrics()
    watch = EngineWatch(client)
    watch.kick()
    eventually(lambda: watch.latest is not None, timeout_s=30)

    def loop_with(engine: WatchedEngine) -> GovernorLoop:
        decider = SupervisedDecider(policy, supervisor)
        return GovernorLoop(sampler, decider, engine, RealClock(), listeners=[state.on_tick, metrics.on_tick])

    watched, polled = loop_with(WatchedEngine(watch)), loop_with(PolledEngine(client))
    snapshot = sampler.sample()
    observed = watch.latest
    t0 = time.monotonic()
    last = watched.tick()

    def decide() -> None:
        policy.decide(snapshot, observed, time.monotonic() - t0)

    def listeners() -> None:
        state.on_tick(1.0, snapshot, observed, last)
        metrics.on_tick(1.0, snapshot, observed, last)

    rounds: dict[str, list[float]] = {"tick": [], "polled": [], "sample": [], "decide": [], "listeners": []}
    try:
        for _ in range(5):
            rounds["tick"].append(cpu_ms(watched.tick, ticks))
            rounds["polled"].append(cpu_ms(polled.tick, max(ticks // 10, 10)))
            rounds["sample"].append(cpu_ms(sampler.sample, ticks))
            rounds["decide"].append(cpu_ms(decide, ticks))
            rounds["listeners"].append(cpu_ms(listeners, ticks))
    finally:
        watch.close()
    return {name: statistics.median(values) for name, values in rounds.items()}


def daemon_rss(root: Path, ladder_path: Path, work: Path) -> tuple[float, float]:
    """(daemon RSS MB, engine RSS MB) of a real `governor run`, once it is ready."""
    control = work / "c.sock"
    argv = [
        sys.executable, "-m", "governor", "--log-json", "run", "--root", str(root), "--models", str(ladder_path),
        "--control-socket", str(control), "--engine-socket", str(work / "e.sock"), "--state-dir", str(work / "state"),
        "--no-udev",
    ]  # fmt: skip
    with (work / "daemon.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = ControlClient(control)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if control.exists() and client.request("status")["status"]["supervisor"]["ready"]:
                break
            if proc.poll() is not None:
                raise SystemExit(f"governor run exited: {(work / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.2)
        time.sleep(2.0)  # a few ticks with the engine answering
        me = psutil.Process(proc.pid)
        engine = sum(child.memory_info().rss for child in me.children(recursive=True))
        return me.memory_info().rss / 1e6, engine / 1e6
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=2000)
    args = parser.parse_args()
    logs.configure(level=logging.WARNING)  # the loop's decision lines are not the figures
    work = Path(tempfile.mkdtemp(prefix="gvb", dir="/tmp"))
    try:
        tree = FakeTree(work / "root").laptop()
        ladder_path = write_demo_models(REPO / RANDOM_DIR)
        with engine_process(ladder_path, work) as client:
            ms = per_tick(tree.root, ladder_path, args.ticks, client)
        print(f"daemon CPU per tick over {args.ticks} ticks (median of 5 rounds; shared 2-core machine, noisy):")
        tick = ms["tick"]
        print(f"  whole tick   {tick:7.3f} ms   ratio to the {TICK_GOAL_MS} ms goal: {tick / TICK_GOAL_MS:.2f}")
        polled = ms["polled"]
        print(f"  the same tick polling GET /engine/status: {polled:7.3f} ms   pushed ÷ polled: {tick / polled:.3f}")
        for part in ("sample", "decide", "listeners"):
            print(f"    {part:10s} {ms[part]:7.3f} ms   ({ms[part] / ms['tick']:.0%} of a tick)")
        rss, engine = daemon_rss(tree.root, ladder_path, work)
        ratio = rss / RSS_GOAL_MB
        print(f"daemon RSS without the engine: {rss:6.1f} MB   ratio to the {RSS_GOAL_MB:g} MB goal: {ratio:.2f}")
        print(f"  (the engine child beside it: {engine:.0f} MB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
