"""Threads on cores of different speed (issue 27, point 4) and the never-lose rule on the thread count (point 3)."""

from __future__ import annotations

import itertools

import pytest

from policies.cores import Cores
from policies.decision import Decision, State
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


def test_android_termux_runs_the_fastest_count_on_the_phones_cores() -> None:
    """Its thread count is the phone's, not a number: on 2 big + 6 little cores at 0.3 of a big one, all 8 threads
    (2.4 big-core equivalents) beat the 2 big cores alone (2.0); at 0.25 the 8 only tie them, and the 2 big cores run
    alone (the same tokens for less power). The fixed 4 it had gave 1.2 on both, and on issue 27's random phones half
    the ungoverned engine's tokens."""
    for clusters, threads in ((BIG_LITTLE, 8), (LITTLER, 2)):
        gov = StateMachine(load_policy("android-termux"))
        decision = gov.decide(phone(4, clusters), EngineObservation(busy=False), 0.0)
        assert decision.engine.threads == threads


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


def test_the_slowest_cluster_alone_costs_a_capacitys_share_of_the_power_per_token() -> None:
    cores = Cores(BIG_LITTLE, 8)
    assert cores.slow_cpus == (0, 1, 2, 3, 4, 5)
    assert [cores.speed(n, slow=True) for n in (1, 6, 8)] == pytest.approx([0.3, 1.8, 1.8])  # 6 cores there
    assert cores.power(6, slow=True) == pytest.approx(6 * 0.09)
    assert cores.cpus(3, slow=True) == (0, 1, 2, 3, 4, 5)
    assert Cores((), 4).slow_cpus == ()


def hot_phone(
    clusters: tuple[Cluster, ...],
    seconds: int,
    temp_c: float = 58.8,
    gov: StateMachine | None = None,
    available_mb: float = 4096.0,
) -> list[Decision]:
    """`default` on an 8-core phone whose clock Termux cannot set, its zone held at `temp_c` (the trip 60 °C, hot's
    setpoint 58 °C: over it the PI cuts to its floor), driving an engine that decodes 5 tok/s per big-core equivalent
    where it is placed, up to the cap."""
    gov = gov or StateMachine(load_policy("default"))
    cores = Cores(clusters, 8)
    hot = snap(temp_c, trips=[("passive", 60.0)], available_mb=available_mb)
    out: list[Decision] = []
    threads, rate = 8, None
    cpus: tuple[int, ...] = ()
    start = int(gov.last.t) + 1 if gov.last is not None else 0
    for t in range(start, start + seconds):
        slow = bool(cpus) and cpus == cores.slow_cpus
        speed = 5.0 * cores.speed(threads, slow=slow)
        tok = speed if rate is None else min(speed, rate)
        engine = EngineObservation(busy=True, tokens_per_s=tok, model="m", threads=threads)
        cpu = Cpu(freq_ratio=1.0, throttled=False, count=8, clusters=clusters, other_cores=0.05, engine_cores=threads,
                  run_queue=threads + 1)  # fmt: skip
        decision = gov.decide(hot.model_copy(update={"cpu": cpu}), engine, float(t))
        threads, cpus, rate = decision.engine.threads, decision.affinity or (), decision.engine.max_tokens_per_s
        out.append(decision)
    return out


def test_in_hot_without_a_clock_the_phone_spends_hots_power_on_its_little_cores() -> None:
    """Hot's floor on the big cores is one thread under a rate cap; the same watts on the 0.3-capacity cores alone
    decode 1 / 0.3 as many tokens (issue 27's randomized phones: 0.57 -> 1.04 x the ungoverned engine's tokens over
    a long chat, at 0.87 x its J/token, without the kernel throttling). The why names the rule."""
    seen = hot_phone(BIG_LITTLE, 300)
    last = seen[-1]
    assert last.state.value == "hot"
    assert last.affinity == (0, 1, 2, 3, 4, 5)
    assert last.rule == "thermal.slow_cores"
    assert "threads on CPUs 0-5, the slowest cores" in last.reason
    floor = load_policy("default").states[State.HOT].rate_range[0]
    assert floor is not None
    assert last.engine.max_tokens_per_s is not None
    assert last.engine.max_tokens_per_s >= 2.5 * floor  # the floor's watts on the little cores
    assert sum(1 for a, b in itertools.pairwise(seen) if a.affinity != b.affinity) <= 3  # no flapping


def test_near_the_trip_with_the_pi_at_its_floor_the_little_cores_fall_back_to_the_floors_tokens() -> None:
    """Where the little cores draw more than the model's capacity² (or the world heats the zone), hot's floor must
    still be reachable: within 0.5 °C of the trip with the PI at its floor their cap falls toward what hot's floor gives
    on a big core (the same tokens for less power), all the way at the trip, and they stay where they are."""
    floor = load_policy("default").states[State.HOT].rate_range[0]
    caps = {}
    for temp in (59.0, 59.75, 60.0):
        last = hot_phone(BIG_LITTLE, 300, temp_c=temp)[-1]
        assert last.affinity == (0, 1, 2, 3, 4, 5)
        caps[temp] = last.engine.max_tokens_per_s
    assert caps[60.0] == floor
    assert caps[59.0] is not None
    assert caps[59.75] is not None
    assert floor is not None
    assert floor < caps[59.75] < caps[59.0]


def test_uncapped_on_the_little_cores_just_under_the_setpoint_the_pi_holds_its_output() -> None:
    """A budget the little cores cannot use would wind the PI up until the big cores won it back, heating the zone past
    the setpoint each time: running uncapped within 0.5 °C under it, the output holds; further under, it rises."""
    gov = StateMachine(load_policy("default"))
    hot_phone(BIG_LITTLE, 300, gov=gov)  # to the little cores
    near = hot_phone(BIG_LITTLE, 120, temp_c=57.7, gov=gov)
    assert all(d.affinity == (0, 1, 2, 3, 4, 5) for d in near[-60:])
    held = gov.hot.u
    hot_phone(BIG_LITTLE, 60, temp_c=57.7, gov=gov)
    assert held is not None
    assert gov.hot.u == held
    hot_phone(BIG_LITTLE, 60, temp_c=56.0, gov=gov)  # room to spare: the PI goes on
    assert gov.hot.u is not None
    assert gov.hot.u > held


def test_on_alike_cores_hot_places_nothing() -> None:
    """(There the kernel's clock steps take hot's power instead: tests/policies/test_kernel.py.)"""
    seen = hot_phone((Cluster(cpus=tuple(range(8)), capacity=1.0),), 120)
    assert all(d.affinity is None for d in seen)
    assert all(d.rule != "thermal.slow_cores" for d in seen)
    assert seen[-1].rule == "thermal.kernel"


def test_where_critical_for_memory_borrows_hots_limits_the_threads_stay_on_the_fastest_cores() -> None:
    """There hot's limits apply only while the zone is over the setpoint, so they come and go; a move to the little
    cores and back each time doubled the config changes (fleet:2:181's burst, 28.8 -> 41.7 a minute)."""
    seen = hot_phone(BIG_LITTLE, 300, available_mb=50.0)
    assert seen[-1].state.value == "critical"
    assert seen[-1].engine.max_tokens_per_s is not None  # hot's limits in force
    assert all(d.affinity != (0, 1, 2, 3, 4, 5) for d in seen)
