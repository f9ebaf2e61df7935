"""Routing to an upstream: what the daemon's proxy costs a streamed answer, side by side with a direct connection.

    .venv/bin/python bench/bench_routing.py [--runs 7] [--tokens 128] [--tier NAME] [--quick]

One real `governor engine` (a demo ladder tier) plays the upstream on its own Unix socket. The daemon's
`ProxyServer` runs in this process with a `Router` that has that engine as its one `[[upstream]]` and a gate saying
the device's engine is down, so every chat request is routed (httpx, streamed through, first event marked). Each
round streams the same greedy answer once directly from the upstream and once through the proxy, in alternating
order (the machine is shared and loaded: pairs see the same load), and prints:
- decode tokens/s through the proxy ÷ direct: the median of the per-round ratios (goal >= 0.97, i.e. <= 3 % overhead);
- the proxy's CPU per token: this process's CPU time in a proxied round minus in a direct round (the client runs in
  both), ÷ tokens, next to the upstream engine's own CPU per token from /proc (goal: <= 3 % of it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.bench_proxy import cpu_s
from bench.engine_common import SAMPLING, measure_stream, our_engine, served
from governor.daemon.config import Upstream
from governor.daemon.proxy import ProxyServer
from governor.daemon.routing import Router, UpstreamLink
from governor.daemon.supervisor import Availability
from governor.engine import demo
from governor.engine.client import EngineClient
from policies.ladder import load_ladder

ROOT = Path(__file__).resolve().parent.parent


class EngineDown:
    """The supervisor's side of the proxy for a device whose engine is restarting: chat goes upstream."""

    def availability(self) -> Availability:
        return Availability(ready=False, given_up=False, reason="the engine is restarting", retry_after_s=1)

    def request_started(self, *, chat: bool) -> int:
        return 1

    def request_ended(self, start: int) -> None:
        pass

    def exit_of(self, start: int) -> str | None:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--tier", help="the demo ladder tier (default: its first)")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 48 tokens")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.tokens = 3, 48
    ladder_path = demo.write_demo_models(Path(os.environ.get("GOVERNOR_DEMO_DIR") or ROOT / "demo-models"))
    tier = args.tier or load_ladder(ladder_path).tiers[0].name
    messages = [{"role": "user", "content": "Tell me a long story about the people of the world."}]
    body = {"max_tokens": args.tokens, "ignore_eos": True, **SAMPLING}
    with tempfile.TemporaryDirectory(prefix="gvr", dir="/tmp") as tmp:
        up_sock, public = Path(tmp) / "up.sock", Path(tmp) / "e.sock"
        cmd = our_engine(up_sock, "--models", str(ladder_path), "--tier", tier, "--threads", "2")
        with served(cmd, up_sock) as server:
            direct = server.client
            engine_pid = direct.status().model_extra["pid"]  # type: ignore[index]
            link = UpstreamLink(Upstream(name="lan", base_url="http://upstream/v1", socket=up_sock), "sk-bench")
            router = Router([link], policy=lambda: None, engine_status=lambda: None)
            proxy = ProxyServer(public, Path(tmp) / "unused.sock", EngineDown(), hold_s=5.0, drain_s=5, router=router)
            proxy.start()
            try:
                with EngineClient(public, timeout_s=30) as proxied:
                    sides = {"direct": direct, "routed": proxied}
                    tps: dict[str, list[float]] = {k: [] for k in sides}
                    own_cpu: dict[str, list[float]] = {k: [] for k in sides}
                    engine_cpu: list[float] = []
                    for side in sides.values():  # warm-up: first prefill, connections, caches
                        measure_stream(side.stream_chat(messages, model=tier, **body), args.tokens)
                    for r in range(args.runs):
                        order = list(sides) if r % 2 == 0 else list(reversed(sides))
                        for name in order:
                            c0, e0 = time.process_time(), cpu_s(engine_pid)
                            run = measure_stream(sides[name].stream_chat(messages, model=tier, **body), args.tokens)
                            own_cpu[name].append(time.process_time() - c0)
                            engine_cpu.append(cpu_s(engine_pid) - e0)
                            tps[name].append(run.decode_tps)
                    assert link.requests == args.runs + 1, "every proxied request went upstream"
            finally:
                proxy.close(10.0)
    ratios = [p / d for p, d in zip(tps["routed"], tps["direct"], strict=True) if d]
    proxy_cpu_per_token = [(p - d) / args.tokens for p, d in zip(own_cpu["routed"], own_cpu["direct"], strict=True)]
    engine_per_token = statistics.median(engine_cpu) / args.tokens
    print(f"routing overhead, upstream tier {tier}: {args.tokens} tokens streamed, greedy, {args.runs} paired rounds")
    for name in sides:
        each = tps[name]
        print(f"  {name:<8} {statistics.median(each):8.1f} tok/s  (min {min(each):.1f}, max {max(each):.1f})")
    print(
        f"  routed ÷ direct decode tok/s {statistics.median(ratios):6.3f}   "
        f"(goal >= 0.97; rounds {min(ratios):.3f}-{max(ratios):.3f})"
    )
    proxy_us = statistics.median(proxy_cpu_per_token) * 1e6
    print(
        f"  proxy CPU per token {proxy_us:7.1f} µs   upstream engine CPU per token {engine_per_token * 1e6:9.1f} µs   "
        f"ratio {proxy_us / (engine_per_token * 1e6):.4f} (goal <= 0.03)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
