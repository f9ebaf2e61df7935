"""The daemon's public-socket proxy: what it costs a streamed answer, side by side with a direct connection.

    .venv/bin/python bench/bench_proxy.py [--runs 7] [--tokens 128] [--tier NAME] [--quick]

One real `governor engine` (a demo ladder tier, 2 threads) on its own socket, and the daemon's `ProxyServer` in this
process in front of it, measured twice in one run:
- local: the engine is the daemon's engine child and the gate says "ready" (every answer on the device goes this way);
- routed (issue 12): the engine plays an `[[upstream]]` of a `Router` and the gate says the device's engine is down, so
  every chat request is routed (the upstream link, streamed through, first event marked).
Each round streams the same greedy answer once directly and once through the proxy, in alternating order (the machine
is shared and loaded: pairs see the same load), and prints per mode:
- decode tokens/s through the proxy ÷ direct: the median of the per-round ratios (goal >= 0.99 local, >= 0.97 routed);
- the proxy's CPU per token: this process's CPU time in a proxied round minus in a direct round (the client runs in
  both), ÷ tokens, next to the engine's own CPU per token from /proc (goal < 1 % of it local, <= 3 % routed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engine_common import SAMPLING, measure_stream, our_engine, served
from governor.daemon.config import Upstream
from governor.daemon.publicsocket import ProxyServer
from governor.daemon.restarts import Availability
from governor.daemon.routing import Router, UpstreamLink
from governor.demo import models as demo
from governor.engine.client import EngineClient
from policies.ladder import load_ladder

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Gate:
    """The supervisor's side of the proxy: an engine that is up (local) or restarting (chat goes upstream)."""

    ready: bool

    def availability(self) -> Availability:
        reason = "" if self.ready else "the engine is restarting"
        return Availability(ready=self.ready, given_up=False, reason=reason, retry_after_s=0 if self.ready else 1)

    def request_started(self, *, chat: bool) -> int:
        return 1

    def request_ended(self, start: int, *, answered: bool) -> None:
        pass

    def exit_of(self, start: int) -> str | None:
        return None


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def measure(mode: str, ladder_path: Path, tier: str, runs: int, tokens: int) -> None:
    messages = [{"role": "user", "content": "Tell me a long story about the people of the world."}]
    body: dict[str, Any] = {"max_tokens": tokens, "ignore_eos": True, **SAMPLING}
    routed = mode == "routed"
    with tempfile.TemporaryDirectory(prefix="gvp", dir="/tmp") as tmp:
        engine_sock, public = Path(tmp) / "engine.sock", Path(tmp) / "e.sock"
        cmd = our_engine(engine_sock, "--models", str(ladder_path), "--tier", tier, "--threads", "2")
        with served(cmd, engine_sock) as server:
            direct = server.client
            engine_pid = direct.status().model_extra["pid"]  # type: ignore[index]
            router = None
            if routed:
                link = UpstreamLink(Upstream(name="lan", base_url="http://upstream/v1", socket=engine_sock), "sk-bench")
                router = Router([link], policy=lambda: None, engine_status=lambda: None)
            child = Path(tmp) / "unused.sock" if routed else engine_sock
            proxy = ProxyServer(public, child, Gate(ready=not routed), hold_s=5.0, drain_s=5, router=router)
            proxy.start()
            try:
                with EngineClient(public, timeout_s=30) as proxied:
                    if not routed:
                        proxied.wait_ready(30)
                    sides = {"direct": direct, mode: proxied}
                    tps: dict[str, list[float]] = {k: [] for k in sides}
                    own_cpu: dict[str, list[float]] = {k: [] for k in sides}
                    engine_cpu: list[float] = []
                    for side in sides.values():  # warm-up: first prefill, connections, caches
                        measure_stream(side.stream_chat(messages, model=tier, **body), tokens)
                    for r in range(runs):
                        order = list(sides) if r % 2 == 0 else list(reversed(sides))
                        for name in order:
                            c0, e0 = time.process_time(), cpu_s(engine_pid)
                            run = measure_stream(sides[name].stream_chat(messages, model=tier, **body), tokens)
                            own_cpu[name].append(time.process_time() - c0)
                            engine_cpu.append(cpu_s(engine_pid) - e0)
                            tps[name].append(run.decode_tps)
                    if router is not None:
                        assert link.requests == runs + 1, "every proxied request went upstream"
            finally:
                proxy.close(10.0)
    ratios = [p / d for p, d in zip(tps[mode], tps["direct"], strict=True) if d]
    proxy_cpu_per_token = [(p - d) / tokens for p, d in zip(own_cpu[mode], own_cpu["direct"], strict=True)]
    engine_per_token = statistics.median(engine_cpu) / tokens
    goal_tps, goal_cpu = (0.97, "<= 0.03") if routed else (0.99, "< 0.01")
    print(f"proxy overhead, {mode}, tier {tier}: {tokens} tokens streamed, greedy, 2 threads, {runs} paired rounds")
    for name in sides:
        each = tps[name]
        print(f"  {name:<8} {statistics.median(each):8.1f} tok/s  (min {min(each):.1f}, max {max(each):.1f})")
    print(
        f"  {mode} ÷ direct decode tok/s {statistics.median(ratios):6.3f}   "
        f"(goal >= {goal_tps}; rounds {min(ratios):.3f}-{max(ratios):.3f})"
    )
    proxy_us = statistics.median(proxy_cpu_per_token) * 1e6
    print(
        f"  proxy CPU per token {proxy_us:7.1f} µs   engine CPU per token {engine_per_token * 1e6:9.1f} µs   "
        f"ratio {proxy_us / (engine_per_token * 1e6):.4f} (goal {goal_cpu})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--tier", help="the demo ladder tier (default: its first)")
    parser.add_argument("--mode", choices=("local", "routed"), action="append", help="default: both")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 48 tokens")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.tokens = 3, 48
    ladder_path = demo.write_demo_models(Path(os.environ.get("GOVERNOR_DEMO_DIR") or ROOT / demo.RANDOM_DIR))
    tier = args.tier or load_ladder(ladder_path).tiers[0].name
    for mode in args.mode or ("local", "routed"):
        measure(mode, ladder_path, tier, args.runs, args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
