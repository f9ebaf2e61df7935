"""Threads on cores of different speed (issue 27, point 4) and the never-lose rule on the thread count (point 3)."""

from __future__ import annotations

import pytest

from policies.cores import Cores
from policies.decision import Decision
from policies.loader import load_policy
from policies.machine import StateMachine
from sensors.snapshot import Cluster, Cpu, EngineObservation, Snapshot
from tests.policies.builders import snap

BIG_LITTLE = (Cluster(cpus=(6, 7), capacity=1.0), Cluster(cpus=(0, 1, 2, 3, 4, 5), capacity=0.3))


def test_n_threads_run_at_the_pace_of_the_nth_fastest_core() -> None:
    cores = Cores(BIG_LITTLE, 8)
    assert [cores.speed(n) for n in (1, 2, 3, 8)] == pytest.approx([1.0, 2.0, 0.9, 2.4])
    assert cores.best(4) == 2  # 4 threads at 0.3 (1.2) lose to the 2 big cores alone
    assert cores.best(8) == 8  # ... and all 8 (2.4) beat them
    assert cores.power(8) == pytest.approx(2 + 6 * 0.09)
    assert cores.cpus(2) == (6, 7)  # placed on the big cluster
    alike = Cores((), 4)
    assert (alike.best(4), alike.speed(3), alike.cpus(2)) == (4, 3.0, ())


LITTLER = (Cluster(cpus=(6, 7), capacity=1.0), Cluster(cpus=(0, 1, 2, 3, 4, 5), capacity=0.25))


def phone(threads: int, clusters: tuple[Cluster, ...] = BIG_LITTLE) -> Snapshot:
    cpu = Cpu(freq_ratio=1.0, throttled=False, count=8, clusters=clusters, other_cores=0.05, engine_cores=threads,
              run_queue=threads + 1)  # fmt: skip
    return snap(30.0).model_copy(update={"cpu": cpu})


def test_android_termux_runs_the_big_cores_only_on_a_2_plus_6_phone() -> None:
    """Its 4 threads, on the 2 big + 6 little phone of the issue, put 2 threads on little cores: 1.2 big-core
    equivalents where 2 threads give 2.0."""
    gov = StateMachine(load_policy("android-termux"))
    decision = gov.decide(phone(4), EngineObservation(busy=False), 0.0)
    assert decision.engine.threads == 2


def run_engine(speed: dict[int, float], seconds: int) -> list[Decision]:
    """`default` on a 2 big + 6 little phone whose little cores the capacities put at 0.25 of a big one (8 threads:
    2.0 big-core equivalents, a tie with the 2 big cores: the policy runs 2), driving an engine whose measured decode
    speed per thread count is `speed` (what llama.cpp really does on these cores)."""
    gov = StateMachine(load_policy("default"))
    out, threads = [], 8
    for t in range(seconds):
        engine = EngineObservation(busy=True, tokens_per_s=speed.get(threads, 1.0), model="m", threads=threads)
        decision = gov.decide(phone(threads, LITTLER), engine, float(t))
        threads = decision.engine.threads
        out.append(decision)
    return out


def test_where_the_cores_model_is_wrong_the_ungoverned_count_wins_and_the_why_says_pass_through() -> None:
    """This engine hands the fast cores more of the work, and 8 threads measure 3.5 tok/s against 2 threads' 2.0: the
    ungoverned count is measured against the policy's after a probe interval, wins, and stays."""
    seen = run_engine({2: 2.0, 8: 3.5}, 300)
    counts = [d.engine.threads for d in seen]
    assert counts[0] == 2
    assert counts[-1] == 8
    assert next(i for i, n in enumerate(counts) if n == 8) <= 40  # a probe interval, then kept
    assert "pass-through: governed 2.0 tok/s with 2 threads vs 3.5 measured ungoverned (8 threads)" in seen[-1].reason


def test_where_the_cores_model_is_right_the_probe_loses_and_rests() -> None:
    """8 threads at the little cores' pace measure slower, as the capacities said: one short probe, then the count is
    not tried again for 120 s x (2.0 / 1.2)² (from the loser's last comparison)."""
    seen = [d.engine.threads for d in run_engine({2: 2.0, 8: 1.2}, 600)]
    starts = [i for i in range(1, len(seen)) if seen[i] == 8 and seen[i - 1] != 8]
    assert 1 <= len(starts) <= 2, starts
    assert seen.count(8) <= 4 * len(starts)  # a few seconds a probe
    assert seen[-1] == 2
