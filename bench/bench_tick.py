"""The daemon's mitigating tick from inside: CPU of one tick at its fast interval and back to back, and its parts.

The real daemon (`governor.daemon.app.build`, as `governor run` builds it: the shipped default policy, the demo ladder,
bench_footprint's fake tree with the zone at 90 °C, the engine idle) runs on this process's main thread. Once it is
hot, N ticks are timed at the policy's own interval (0.25 s), then N x 10 back to back (the clock's wait returns at
once). CPU is the loop thread's `time.thread_time()` around each tick; the parts (sensor sample, `decide()`, the
listeners) are timed the same way. The two modes differ by what a tick costs on cold caches (see docs/benchmarks.md,
"Fourth round"). Usage: .venv/bin/python bench/bench_tick.py [--ticks 120]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the fake-tree builder lives in tests/

from bench.bench_footprint import footprint_tree
from governor import logs
from governor.clock import RealClock, Signal
from governor.daemon.app import build
from governor.daemon.client import ControlClient
from governor.daemon.config import load_config
from governor.demo.models import RANDOM_DIR, write_demo_models
from tests.helpers import eventually

REPO = Path(__file__).resolve().parent.parent
ZONE = "sys/class/thermal/thermal_zone0/temp"


class SwitchableClock(RealClock):
    """The real clock, whose waits end at once while `back_to_back` is set."""

    back_to_back = False

    def wait(self, event: Signal, timeout_s: float) -> bool:
        return event.is_set() if self.back_to_back else super().wait(event, timeout_s)


class Timed:
    """CPU seconds of the calling thread spent in each wrapped callable, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.cpu: dict[str, float] = {}

    def wrap(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return func(*args, **kwargs)
            finally:
                if self.on:
                    self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - start

        return timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=120, help="ticks at the fast interval (x10 back to back)")
    args = parser.parse_args()
    logs.configure(level=logging.WARNING)
    work, sockets = Path(tempfile.mkdtemp(prefix="gvt", dir="/tmp")), Path(tempfile.mkdtemp(prefix="gvs", dir="/tmp"))
    tree = footprint_tree(work / "root")
    (work / "policy.toml").write_text((REPO / "policies" / "profiles" / "default.toml").read_text())
    (work / "governor.toml").write_text("[restart]\ninitial_s = 0.2\n")
    overrides = {
        "policy": str(work / "policy.toml"), "root": tree.root, "models": write_demo_models(REPO / RANDOM_DIR),
        "control_socket": sockets / "c.sock", "engine_socket": sockets / "e.sock", "state_dir": work / "state",
        "group": None, "metrics_textfile": None, "udev": False,
    }  # fmt: skip
    clock = SwitchableClock()
    daemon = build(load_config(work / "governor.toml", overrides), clock=clock)
    loop, timed = daemon.loop, Timed()
    loop.tick = timed.wrap("tick", loop.tick)  # type: ignore[method-assign]
    loop.sensors.sample = timed.wrap("  sensor sample", loop.sensors.sample)  # type: ignore[method-assign]
    loop.decider.decide = timed.wrap("  decide()", loop.decider.decide)  # type: ignore[method-assign]
    loop.listeners = [timed.wrap("  listeners", listener) for listener in loop.listeners]
    results: dict[str, tuple[int, dict[str, float]]] = {}

    def drive() -> None:
        client = ControlClient(sockets / "c.sock", timeout_s=30)

        def status() -> dict[str, Any]:
            answer: dict[str, Any] = client.request("status")["status"]
            return answer

        eventually(lambda: status()["supervisor"]["ready"] and status()["engine"], timeout_s=180, interval_s=0.2)
        tree.write(ZONE, 90000)
        eventually(lambda: status()["state"] == "hot", timeout_s=60)
        time.sleep(3.0)
        for mode, n in (("at the fast interval", args.ticks), ("back to back", args.ticks * 10)):
            clock.back_to_back = mode == "back to back"
            timed.cpu, start = {}, int(status()["ticks"])
            timed.on = True
            while int(status()["ticks"]) - start < n:
                time.sleep(0.1)
            timed.on = False
            results[mode] = (int(status()["ticks"]) - start, timed.cpu)
        daemon.request_stop()

    threading.Thread(target=drive, daemon=True).start()
    try:
        daemon.run()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)
    print("the daemon's loop thread, CPU per tick (hot, engine idle; shared machine: see docs/benchmarks.md):")
    for mode, (ticks, cpu) in results.items():
        print(f"  {mode} ({ticks} ticks):")
        for name, seconds in cpu.items():
            print(f"    {name:18s} {seconds / max(ticks, 1) * 1e3:7.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
