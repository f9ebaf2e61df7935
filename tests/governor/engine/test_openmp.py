"""The decode threads spin at the graph's barriers, as in-process llama.cpp does, instead of sleeping at each one.

llama-cpp-python's wheel is built with OpenMP (libgomp): every OS thread that runs a llama.cpp computation gets its own
team of threads, which stays. With more teams' threads than CPUs libgomp throttles its spin-waits, and the decode
threads then sleep in a futex at every barrier (about 120 times a token on SmolLM2): a sixth of the decode speed on a
2-core machine. The engine keeps every computation on its worker thread; this counts the sleeps (voluntary context
switches from /proc), which does not depend on how fast or loaded the machine is the way a speed would.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.governor.engine.engine_proc import Engine, real_model, user

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two decode threads need two CPUs"),
]

TOKENS = 96


def thread_stats(pid: int) -> dict[str, tuple[int, int]]:
    """Per thread of `pid`: (run time in ns, voluntary context switches)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            run = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        voluntary = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt"))
        out[tid] = (run, voluntary)
    return out


def test_the_decode_threads_do_not_sleep_at_every_barrier(tmp_path: Path) -> None:
    model = real_model()  # SmolLM2: 30 layers, so ~120 barriers a token
    engine = Engine(tmp_path, "--model", str(model), "--threads", "2", "--ctx", "1024")
    try:
        body = {"model": model.stem, "messages": user("Tell me a story."), "max_tokens": TOKENS, "ignore_eos": True}
        assert engine.chat(**body).status_code == 200  # the worker's team exists, the answer path is warm
        before = thread_stats(engine.proc.pid)
        assert engine.chat(**body).status_code == 200
        after = thread_stats(engine.proc.pid)
    finally:
        engine.stop()
    ran = {tid: (after[tid][0] - before[tid][0], after[tid][1] - before[tid][1]) for tid in after if tid in before}
    decode = sorted(ran.values(), reverse=True)[:2]  # the two threads that ran the most: the decode threads
    sleeps_per_token = [voluntary / TOKENS for _run, voluntary in decode]
    # Throttled libgomp: ~120 a token per thread; spinning: ~0 (a preempted partner can still make one sleep).
    assert max(sleeps_per_token) < 30, sleeps_per_token
