"""`governor bench-device`: measure this device's engine per tier x KV type x threads x clock cap x context fill.

Each (tier, KV type) runs in its own engine child (native code never runs in this process); threads and the clock
cap change live between runs. Decode tokens/s and time to first token are what a streaming client sees; peak RSS is
the engine's own; joules per token where the device reports its power (a discharging battery). The result is a rich
table, a TOML whose `[power]` table is the prior of the policy's device model (`governor run --device-model FILE`),
and optionally a plot.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from govbase.errors import GovernorError
from policies.decision import EngineConfig, KvType
from policies.devicefile import Measured
from policies.schema import Power

# The words of a context-filling prompt: about one token each for a llama vocabulary.
FILL_WORD = "note "


@contextlib.contextmanager
def engine_child(ladder: Path, config: EngineConfig, directory: Path) -> Iterator[object]:
    """An engine process on a private socket, ready; SIGTERM (then SIGKILL) on exit."""
    from governor.daemon.llamacpp import engine_command
    from governor.engine.client import EngineClient, EngineUnavailable

    sock = directory / "bench.sock"
    log = directory / "engine.log"
    with log.open("wb") as out, EngineClient(sock, timeout_s=30) as client:
        proc = subprocess.Popen(engine_command(ladder, sock, config, drain_s=0), stdout=out, stderr=subprocess.STDOUT)
        try:
            try:
                client.wait_ready(300)
            except EngineUnavailable as exc:
                tail = log.read_text(errors="replace")[-600:]
                raise GovernorError(f"the engine did not start for {config.model}/{config.kv_type}: {tail}") from exc
            yield client
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class Grid:
    tiers: Sequence[str]
    kv_types: Sequence[KvType]
    threads: Sequence[int]
    fills: Sequence[int]
    freq_ratios: Sequence[float]
    tokens: int


def measure(client: object, model: str, fill: int, tokens: int) -> tuple[float, float]:
    """(decode tokens/s, time to first token) of one streamed answer after a prompt of about `fill` tokens.

    The decode rate is the engine's own (`governor.decode_tokens_per_s` on the finishing chunk: the tokens after the
    first over the time llama.cpp took to make them), not the chunks' arrival: the engine batches a stream's text
    when its threads take every CPU, and a random-weight model's first tokens may be no text at all, so the client
    can see a whole answer arrive within microseconds."""
    from governor.engine.client import EngineClient

    assert isinstance(client, EngineClient)
    prompt = (FILL_WORD * max(0, fill - 8)) + "Tell me a story."
    start = time.perf_counter()
    first, rate = 0.0, 0.0
    messages = [{"role": "user", "content": prompt}]
    for chunk in client.stream_chat(messages, model=model, max_tokens=tokens, ignore_eos=True):
        choices = chunk.get("choices") or [{}]
        if not first and choices[0].get("delta", {}).get("content"):
            first = time.perf_counter()  # the first text the user sees
        if choices[0].get("finish_reason"):
            rate = float((chunk.get("governor") or {}).get("decode_tokens_per_s") or 0.0)
    return rate, (first - start) if first else 0.0


def run_grid(ladder: Path, grid: Grid, *, root: Path, state_dir: Path, n_ctx: int) -> list[Measured]:
    from governor.daemon.freqcap import FreqCap
    from governor.engine.client import EngineClient
    from sensors.root import Root
    from sensors.sampler import make_sampler

    cap = FreqCap(Root(root), state_dir)
    cap.start()
    ratios = list(grid.freq_ratios) if cap.ratios() is not None else [1.0]
    sampler = make_sampler(root)
    out: list[Measured] = []
    try:
        with tempfile.TemporaryDirectory(prefix="gvbench") as tmp:
            for tier in grid.tiers:
                for kv in grid.kv_types:
                    config = EngineConfig(threads=grid.threads[0], n_ctx=n_ctx, kv_type=kv, model=tier)
                    with engine_child(ladder, config, Path(tmp)) as client:
                        assert isinstance(client, EngineClient)
                        measure(client, tier, 0, 4)  # warm-up: page the weights in
                        for ratio in ratios:
                            cap.cap(ratio)
                            for threads in grid.threads:
                                client.configure(threads=threads)
                                for fill in grid.fills:
                                    rate, ttft = measure(client, tier, fill, grid.tokens)
                                    bat = sampler.sample().battery
                                    discharging = bat is not None and not bat.plugged and bat.power_w
                                    watts = bat.power_w if discharging and bat is not None else None
                                    rss = client.status().rss_bytes or 0
                                    out.append(
                                        Measured(
                                            tier=tier, kv_type=kv, threads=threads, freq_ratio=ratio, ctx_fill=fill,
                                            tokens_per_s=round(rate, 3), ttft_s=round(ttft, 3),
                                            rss_mb=round(rss / (1 << 20), 1),
                                            j_per_token=round(watts / rate, 3) if watts and rate else None,
                                        )
                                    )  # fmt: skip
    finally:
        cap.restore()
        sampler.close()
    return out


def prior_of(runs: Sequence[Measured], base: Power) -> Power:
    """The device model's prior: one thread's decode tokens/s at the top clock (largest tier, shortest fill)."""
    if not runs:
        return base
    tier, fill = runs[0].tier, min(r.ctx_fill for r in runs)
    per_thread = [
        r.tokens_per_s / r.threads
        for r in runs
        if r.tier == tier and r.ctx_fill == fill and r.freq_ratio == 1.0 and r.tokens_per_s > 0
    ]
    if not per_thread:
        return base
    try:  # validated as the loader will: a prior this command writes is one `--device-model` accepts
        return Power.model_validate({**base.model_dump(), "thread_tok_s": round(max(per_thread), 3)})
    except ValidationError as exc:
        raise GovernorError(f"measured {max(per_thread):g} tok/s per thread: {exc.errors()[0]['msg']}") from exc


def write_toml(path: Path, power: Power, runs: Sequence[Measured], header: str) -> None:
    lines = [f"# {line}" for line in header.splitlines()]
    lines += ["[power]"]
    lines += [
        f"{k} = {_toml(v)}"
        for k, v in power.model_dump(exclude={"freq_cap", "control_margin_c"}).items()
        if v is not None
    ]
    for r in runs:
        lines += ["", "[[run]]"] + [f"{k} = {_toml(v)}" for k, v in r.model_dump().items() if v is not None]
    path.write_text("\n".join(lines) + "\n")


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def table(runs: Sequence[Measured]) -> object:
    from rich.table import Table

    t = Table(title="bench-device: decode tokens/s, TTFT and RSS per setting")
    for col in ("tier", "KV", "threads", "clock", "context", "tok/s", "TTFT s", "RSS MB", "J/token"):
        t.add_column(col, justify="left" if col in ("tier", "KV") else "right")
    for r in runs:
        t.add_row(
            r.tier, r.kv_type, str(r.threads), f"{r.freq_ratio * 100:.0f} %", str(r.ctx_fill), f"{r.tokens_per_s:.2f}",
            f"{r.ttft_s:.2f}", f"{r.rss_mb:.0f}", "-" if r.j_per_token is None else f"{r.j_per_token:.2f}",
        )  # fmt: skip
    return t


def plot(runs: Sequence[Measured], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({(r.tier, r.kv_type, r.freq_ratio, r.ctx_fill) for r in runs})
    for key in keys:
        rows = sorted(
            (r for r in runs if (r.tier, r.kv_type, r.freq_ratio, r.ctx_fill) == key), key=lambda r: r.threads
        )
        label = f"{key[0]} {key[1]} clock {key[2] * 100:.0f} % ctx {key[3]}"
        ax.plot([r.threads for r in rows], [r.tokens_per_s for r in rows], "o-", label=label)
    ax.set_xlabel("threads")
    ax.set_ylabel("decode tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"clock caps are shares of the maximum in (0, 1], got {text!r}")
    return values


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench-device",
        help="measure this device: tokens/s, TTFT, RSS (and J/token) per tier x KV x threads x clock x context",
        description="Measure the engine on this device and write the device model's prior (TOML).",
    )
    p.add_argument("--models", type=Path, required=True, help="the model ladder TOML (e.g. the demo models')")
    p.add_argument("--tiers", help="comma-separated tier names (default: every tier)")
    p.add_argument("--kv", default="f16,q8_0", help="KV types (default f16,q8_0)")
    p.add_argument("--threads", type=_ints, help="thread counts (default 1..CPUs)")
    p.add_argument("--fill", type=_ints, default=[0, 384], help="context fills in tokens before the answer")
    p.add_argument("--freq", type=_floats, default=[1.0, 0.8, 0.6], help="clock caps, where writable")
    p.add_argument("--tokens", type=int, default=48, help="tokens decoded per measurement")
    p.add_argument("--ctx", type=int, default=1024, help="n_ctx of every run")
    p.add_argument("--root", type=Path, default=Path("/"), help="where /sys and /proc are (power readings, caps)")
    p.add_argument(
        "--state-dir",
        type=Path,
        help="where caps' originals are saved until restored (default: the daemon's state directory, whose next "
        "start restores them after a crash)",
    )
    p.add_argument("--out", type=Path, default=Path("device.toml"), metavar="FILE.toml")
    p.add_argument("--plot", type=Path, metavar="FILE.png")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from governor.daemon.config import default_dirs
    from policies.ladder import load_ladder

    ladder = load_ladder(args.models)
    names = [t.name for t in ladder.tiers]
    tiers = args.tiers.split(",") if args.tiers else names
    unknown = [t for t in tiers if t not in names]
    if unknown:
        raise GovernorError(f"--tiers: no tier {unknown[0]!r} in {args.models} (tiers: {', '.join(names)})")
    kvs = [k.strip() for k in args.kv.split(",")]
    bad = [k for k in kvs if k not in ("f16", "q8_0", "q4_0")]
    if bad:
        raise GovernorError(f"--kv: {bad[0]!r} is not one of f16, q8_0, q4_0")
    threads = args.threads or list(range(1, (os.cpu_count() or 1) + 1))
    grid = Grid(tiers, kvs, threads, args.fill, args.freq, args.tokens)
    state_dir: Path = args.state_dir or default_dirs()[1]
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    runs = run_grid(args.models, grid, root=args.root, state_dir=state_dir, n_ctx=args.ctx)
    power = prior_of(runs, Power())
    header = (
        f"governor bench-device on {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
        f"ladder {args.models}; {len(runs)} measurements of {args.tokens} decoded tokens each\n"
        "[power].thread_tok_s is measured; idle_w, core_w and freq_exponent are the defaults unless a battery "
        "reported power"
    )
    write_toml(args.out, power, runs, header)
    console = Console(width=140)
    console.print(table(runs))
    console.print(f"prior: {power.thread_tok_s} tok/s per thread at the top clock -> {args.out}")
    if args.plot is not None:
        plot(runs, args.plot)
    return 0
