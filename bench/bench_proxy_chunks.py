"""The proxy's CPU per forwarded chunk, without a model: a scripted engine writes SSE chunks at a steady rate.

    .venv/bin/python bench/bench_proxy_chunks.py [--chunks 2000] [--interval-ms 1] [--rounds 3]

The daemon's `ProxyServer` runs in this process in front of a scripted engine (a child process: one chunked
`text/event-stream` answer of `--chunks` events, one `send()` every `--interval-ms`), and a client child reads the
answer through the proxy's public socket. The figure is the CPU time of the proxy's own thread (`engine-proxy`, from
`/proc/self/task/TID/schedstat`, so neither the engine nor the client is counted) ÷ chunks, and how many times the
thread was put on a CPU per chunk. The chunk rate is far above a real engine's token rate, which only matters in that
the proxy finds several chunks waiting less often at a real rate. CPU time survives a loaded machine better than wall
time; run it a few times. `--profile FILE`: py-spy (if installed) records the proxy thread's stacks into FILE.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_proxy import Gate  # the supervisor side: an engine that is up
from governor.daemon.publicsocket import ProxyServer

ENGINE = textwrap.dedent(
    """
    import json, socket, sys, time
    path, chunks, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(8)
    event = b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": " word"}}]}).encode() + b"\\n\\n"
    frame = b"%x\\r\\n" % len(event) + event + b"\\r\\n"
    while True:
        conn, _ = server.accept()
        data = b""
        while b"\\r\\n\\r\\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\\r\\n\\r\\n")
        length = int(next(l.split(b":")[1] for l in head.split(b"\\r\\n") if l.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-type: text/event-stream\\r\\n"
                     b"transfer-encoding: chunked\\r\\n\\r\\n")
        due = time.monotonic()
        for _ in range(chunks):
            due += interval
            time.sleep(max(0.0, due - time.monotonic()))
            conn.sendall(frame)
        conn.sendall(b"0\\r\\n\\r\\n")
        conn.close()
    """
)

CLIENT = textwrap.dedent(
    """
    import socket, sys
    body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\\r\\nhost: x\\r\\ncontent-type: application/json\\r\\n"
              b"content-length: %d\\r\\n\\r\\n" % len(body) + body)
    data = b""
    while not data.endswith(b"0\\r\\n\\r\\n"):
        got = s.recv(65536)
        if not got:
            sys.exit("connection closed early")
        data += got
    print(data.count(b"data: "))
    """
)


def thread_stat(tid: int) -> tuple[int, int, int]:
    """CPU ns, times put on a CPU, and of those the involuntary ones (preempted, not waiting for I/O)."""
    ns, _wait, runs = (int(x) for x in Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[:3])
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    preempted = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
    return ns, runs, preempted


def proxy_tid() -> int:
    for thread in threading.enumerate():
        if thread.name == "engine-proxy" and thread.native_id is not None:
            return thread.native_id
    raise SystemExit("no proxy thread")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--interval-ms", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=Path, help="py-spy's collapsed stacks of the proxy thread go here")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gvpc", dir="/tmp"))
    engine_sock, public = tmp / "engine.sock", tmp / "public.sock"
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(engine_sock), str(args.chunks), str(args.interval_ms / 1000)]
    )
    proxy = ProxyServer(public, engine_sock, Gate(ready=True), hold_s=5.0, drain_s=1)
    proxy.start()
    spy = None
    try:
        deadline = time.monotonic() + 10
        while not engine_sock.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        client = [sys.executable, "-c", CLIENT, str(public)]
        subprocess.run(client, check=True, capture_output=True)  # warm-up: first connection, imports, caches
        tid = proxy_tid()
        if args.profile is not None:
            spy = subprocess.Popen(
                [
                    *("py-spy", "record", "--pid", str(os.getpid()), "--rate", "2000", "--format", "raw", "--threads"),
                    *("--output", str(args.profile), "--nonblocking"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
        per_chunk_us, runs_per_chunk, preempted_per_chunk = [], [], []
        for _ in range(args.rounds):
            ns0, runs0, pre0 = thread_stat(tid)
            out = subprocess.run(client, check=True, capture_output=True, text=True)
            ns1, runs1, pre1 = thread_stat(tid)
            assert int(out.stdout) == args.chunks, out.stdout
            per_chunk_us.append((ns1 - ns0) / 1e3 / args.chunks)
            runs_per_chunk.append((runs1 - runs0) / args.chunks)
            preempted_per_chunk.append((pre1 - pre0) / args.chunks)
        print(
            f"proxy thread CPU per chunk: median {statistics.median(per_chunk_us):.1f} µs "
            f"(rounds {', '.join(f'{x:.1f}' for x in per_chunk_us)}); "
            f"scheduled {statistics.median(runs_per_chunk):.2f} times per chunk "
            f"({statistics.median(preempted_per_chunk):.2f} of them after being preempted); "
            f"{args.chunks} chunks a round, one every {args.interval_ms} ms; load {os.getloadavg()[0]:.1f}"
        )
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        proxy.close(5.0)
        engine.kill()
        engine.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
