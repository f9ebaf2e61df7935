"""Issue 33's two figures on one real daemon: its memory through the size cases, then a 60 s SIGHUP storm while its
zone heats, ended by a SIGTERM sent during the storm.

    .venv/bin/python bench/bench_storm.py [--storm-s 60]

`governor run` (the random demo ladder, the tests' fast policy: 0.5 s ticks, 0.25 s while mitigating) routes to a
hostile local upstream when hot (tests/faults/hostile.py). Printed:
- memory: the daemon's resident set (VmRSS) before, after one 64 MB request header, after sixteen of them at once from
  another user (uid 65534), after a 300 MB upstream answer; and its peak over all of it (VmHWM). Goal: < 150 MB.
- the storm: os.kill(SIGHUP) back to back from a thread for `--storm-s` seconds while the zone climbs from 45 to 95 °C
  over the first half; the status is read every 50 ms: ticks per second, the longest time the tick count stood still
  (goal: about the policy's interval), when hot was reached, how many reloads the storm became; then SIGTERM (the storm
  still running): the exit code and how long the phased shutdown took, and whether the engine child is gone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from governor.demo.models import RANDOM_DIR, write_demo_models
from tests.faults.hostile import HostileUpstream
from tests.faults.test_sizes import HEADER_MB, flood
from tests.faults.test_upstreams import POLICY, ask
from tests.governor.daemon.daemon_proc import DaemonProc
from tests.helpers import eventually

REPO = Path(__file__).resolve().parent.parent
ZONE_TEMP = "sys/class/thermal/thermal_zone0/temp"
MB = 2**20


def memory(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def size_cases(d: DaemonProc, upstream: HostileUpstream) -> float:
    """The daemon's memory through the size cases; returns its peak (MB)."""
    pid = d.proc.pid
    print(f"daemon ready: VmRSS {memory(pid)[0]:.1f} MB")
    print(f"one {HEADER_MB} MB request header: answered {flood(d, 1)[0]}; VmRSS {memory(pid)[0]:.1f} MB")
    answers = flood(d, 16)
    print(f"sixteen at once from uid 65534: {answers.count('HTTP/1.1_431')} x 431; VmRSS {memory(pid)[0]:.1f} MB")
    d.tree.write(ZONE_TEMP, 95000)
    eventually(lambda: d.status()["routing"]["off_device"], timeout_s=30)
    upstream.mode = "300 MB answer"
    route = ask(d, stream=False).headers["x-governor-route"]
    rss, peak = memory(pid)
    print(f"a 300 MB upstream answer: refused, answered by {route}; VmRSS {rss:.1f} MB; peak (VmHWM) {peak:.1f} MB")
    d.tree.write(ZONE_TEMP, 45000)
    eventually(lambda: d.status()["state"] in ("idle", "sustained"), timeout_s=60)
    return peak


def storm(d: DaemonProc, seconds: float) -> None:
    """SIGHUPs back to back while the zone heats; the status read every 50 ms; SIGTERM at the end, mid-storm."""
    pid = d.proc.pid
    reloads0 = d.status()["policy"]["reloads"]
    stop = threading.Event()

    def kill_loop() -> None:
        while not stop.is_set():
            try:
                os.kill(pid, signal.SIGHUP)
            except ProcessLookupError:
                return

    began = time.monotonic()
    threading.Thread(target=kill_loop, daemon=True).start()
    seen: list[tuple[float, int, str]] = []
    while (now := time.monotonic() - began) < seconds:
        d.tree.write(ZONE_TEMP, int(45000 + min(1.0, now / (seconds / 2)) * 50000))
        status = d.status()
        seen.append((now, status["ticks"], status["state"]))
        time.sleep(0.05)
    reloads = d.status()["policy"]["reloads"] - reloads0
    engine_pid = d.status()["supervisor"]["pid"]
    peak = memory(pid)[1]
    hot_at = next((t for t, _, state in seen if state == "hot"), None)
    stall, since = 0.0, seen[0]
    for sample in seen[1:]:
        if sample[1] != since[1]:
            stall, since = max(stall, sample[0] - since[0]), sample
    ticks = seen[-1][1] - seen[0][1]
    print(
        f"{seconds:.0f} s SIGHUP storm, zone 45 -> 95 °C over {seconds / 2:.0f} s: {ticks} ticks "
        f"({ticks / (seen[-1][0] - seen[0][0]):.2f}/s), the tick count stood still at most {stall:.2f} s, hot "
        f"after {hot_at if hot_at is None else round(hot_at, 1)} s, {reloads} reloads"
    )
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)  # the storm still runs
    code = d.proc.wait(120)
    stop.set()
    gone = not Path(f"/proc/{engine_pid}").exists()
    left = [p.name for p in d.control.parent.iterdir()]
    print(
        f"SIGTERM during the storm: exit {code} after {time.monotonic() - t0:.1f} s; engine child gone: {gone}; "
        f"sockets left: {left}; the daemon's peak (VmHWM) over the whole run: {peak:.1f} MB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storm-s", type=float, default=60.0)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_storm: needs root (the header flood comes from another user, uid 65534): skipped")
        return 0
    ladder = write_demo_models(REPO / RANDOM_DIR)
    work = Path(tempfile.mkdtemp(prefix="gvstorm"))
    sockets = Path(tempfile.mkdtemp(prefix="gvst", dir="/tmp"))
    upstream = HostileUpstream()
    config = "\n".join(
        [
            "[restart]",
            "initial_s = 0.2",
            "[[upstream]]",
            'name = "lan"',
            f'base_url = "http://127.0.0.1:{upstream.port}/v1"',
            "timeout_s = 5.0",
            "retry_after_s = 0.0",
        ]
    )
    d = DaemonProc(work, sockets, ladder, policy=POLICY, config=config + "\n")
    try:
        d.wait_ready()
        size_cases(d, upstream)
        storm(d, args.storm_s)
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        upstream.close()
        shutil.rmtree(sockets, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
