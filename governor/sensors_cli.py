"""`governor sensors`: one snapshot (one per interval with --watch) as a table, or JSON lines (the trace format)."""

from __future__ import annotations

import argparse
import shlex
import signal
import threading
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from govbase.errors import GovernorError
from sensors.events import UdevEvents
from sensors.sampler import make_sampler
from sensors.snapshot import Battery, Cpu, Memory, Snapshot


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "sensors",
        help="show temperatures, battery, memory and CPU frequency",
        description="Read the device's sensors under a root prefix and print a table, or JSON lines with --json.",
    )
    parser.add_argument("--root", type=Path, default=Path("/"), metavar="DIR", help="read DIR/sys and DIR/proc")
    parser.add_argument("--json", action="store_true", help="one JSON object per snapshot per line (trace format)")
    parser.add_argument("--watch", action="store_true", help="keep sampling until Ctrl-C")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between samples (2)")
    parser.add_argument("--count", type=int, default=None, metavar="N", help="with --watch, stop after N snapshots")
    parser.add_argument(
        "--termux-command",
        metavar="CMD",
        help="battery status command printing termux-battery-status JSON (default under Termux: termux-battery-status)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.root.is_dir():
        raise GovernorError(f"--root {args.root}: no such directory")
    if args.interval <= 0:
        raise GovernorError(f"--interval {args.interval:g}: must be more than 0 seconds")
    if args.count is not None and args.count < 1:
        raise GovernorError(f"--count {args.count}: must be at least 1")
    command = shlex.split(args.termux_command) if args.termux_command else None
    sampler = make_sampler(args.root, termux_cmd=command)
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 160  # piped or captured: rich's 80-column default would wrap table cells
    wake, stop = threading.Event(), threading.Event()
    events = UdevEvents(lambda _event: wake.set())
    if args.watch and args.root == Path("/"):
        events.start()  # a charger plugged in shows at once instead of at the next interval
    if args.watch:
        # Ctrl-C / SIGTERM end the watch between two samples: an exception raised wherever the main thread happens to
        # be (inside a library's lock, a log handler) could leave a lock held that the exit then waits on.
        def ask_stop(_signum: int, _frame: object) -> None:
            stop.set()
            wake.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, ask_stop)
    shown = 0
    try:
        if not args.watch:
            sampler.warm_up()
        if not args.json:
            for note in sampler.notes():
                console.print(note, soft_wrap=True)
        while True:
            snapshot = sampler.sample()
            if args.json:
                print(snapshot.model_dump_json(), flush=True)
            else:
                _print_table(console, snapshot, stamp=args.watch)
            shown += 1
            if not args.watch or (args.count is not None and shown >= args.count):
                return 0
            wake.wait(args.interval)
            wake.clear()
            if stop.is_set():
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        events.stop()
        sampler.close()


def _num(value: float | None, fmt: str, unit: str) -> str:
    return "unknown" if value is None else f"{value:{fmt}}{unit}"


def _bytes(value: int | None) -> str:
    return "unknown" if value is None else f"{value / 2**30:.2f} GiB"


def _battery(battery: Battery | None) -> str:
    if battery is None:
        return "none"
    state = {True: "charging", False: "not charging", None: "charging unknown"}[battery.charging]
    plug = {True: "on external power", False: "on battery", None: "power source unknown"}[battery.plugged]
    age = f", {battery.age_s:.0f} s old" if battery.age_s is not None else ""
    return (
        f"{_num(battery.percent, '.0f', ' %')}, {state}, {plug}, power {_num(battery.power_w, '.2f', ' W')}, "
        f"temperature {_num(battery.temp_c, '.1f', ' °C')} ({battery.source}{age})"
    )


def _memory(memory: Memory) -> str:
    return (
        f"{_bytes(memory.available_bytes)} available of {_bytes(memory.total_bytes)}; "
        f"swap {_bytes(memory.swap_free_bytes)} free of {_bytes(memory.swap_total_bytes)}; "
        f"pressure some {_num(memory.psi_some_avg10, '.2f', ' %')}, full {_num(memory.psi_full_avg10, '.2f', ' %')}"
    )


def _cpu(cpu: Cpu) -> str:
    throttled = {True: "yes", False: "no", None: "unknown"}[cpu.throttled]
    ratio = None if cpu.freq_ratio is None else cpu.freq_ratio * 100
    return (
        f"{cpu.count if cpu.count is not None else 'unknown'} CPUs, frequency {_num(ratio, '.0f', ' %')} of max, "
        f"throttled: {throttled}, busy {_num(cpu.util_percent, '.0f', ' %')}; other processes "
        f"{_num(cpu.other_cores, '.2f', ' cores')}, run queue {_num(cpu.run_queue, 'd', '')}, "
        f"pressure some {_num(cpu.psi_some_avg10, '.2f', ' %')}"
    )


def _print_table(console: Console, snapshot: Snapshot, *, stamp: bool) -> None:
    if stamp:
        console.rule(datetime.now(UTC).strftime("%H:%M:%S UTC"))
    if snapshot.temperatures:
        table = Table("source", "kind", "label", "°C", "trips", title="temperatures")
        for t in snapshot.temperatures:
            trips = ", ".join(f"{trip.type} {trip.temp_c:g}" for trip in t.trips)
            table.add_row(t.source, t.kind, t.label, _num(t.temp_c, ".1f", ""), trips)
        console.print(table)
    else:
        console.print("temperatures: none readable")
    console.print(f"battery: {_battery(snapshot.battery)}", soft_wrap=True)
    console.print(f"memory: {_memory(snapshot.memory)}", soft_wrap=True)
    console.print(f"cpu: {_cpu(snapshot.cpu)}", soft_wrap=True)
    if snapshot.problems:
        table = Table("path", "problem", title="problems (these readings are unknown)")
        for problem in snapshot.problems:
            table.add_row(problem.path, problem.reason)
        console.print(table)
    else:
        console.print("problems: none")
