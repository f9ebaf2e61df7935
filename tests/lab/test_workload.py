"""The workload driver: closed-loop chat, random questions, events; the same seed gives the same questions."""

from __future__ import annotations

from governor.lab.workload import Driver, EventSpec, PhaseSpec, WorkloadSpec, load_workload


def chat(duration_s: float = 100.0) -> WorkloadSpec:
    return WorkloadSpec(name="c", phase=(PhaseSpec(kind="chat", duration_s=duration_s, think_s=(5.0, 5.0)),))


def test_chat_asks_again_a_think_time_after_each_answer() -> None:
    driver = Driver(chat())
    first = driver.arrivals(0.0)
    assert [r.arrival_s for r in first] == [0.0]
    assert driver.arrivals(50.0) == []  # no answer yet: the user waits
    driver.answered(20.0)
    assert driver.arrivals(24.9) == []
    (second,) = driver.arrivals(25.0)
    assert second.arrival_s == 25.0


def test_chat_stops_at_the_end_of_its_phase_and_the_next_phase_starts() -> None:
    spec = WorkloadSpec(
        name="c",
        phase=(
            PhaseSpec(kind="chat", duration_s=30.0, think_s=(5.0, 5.0)),
            PhaseSpec(kind="idle", duration_s=100.0),
            PhaseSpec(kind="chat", duration_s=30.0, think_s=(5.0, 5.0)),
        ),
    )
    driver = Driver(spec)
    assert len(driver.arrivals(0.0)) == 1
    driver.answered(28.0)  # the next turn would be at 33 s, after the phase
    assert driver.arrivals(129.0) == []
    (again,) = driver.arrivals(130.0)
    assert again.arrival_s == 130.0


def test_same_seed_same_questions_different_seed_different() -> None:
    spec = WorkloadSpec(name="p", phase=(PhaseSpec(kind="poisson", duration_s=36_000, rate_per_h=6),))
    a = [(r.arrival_s, r.prompt_tokens, r.answer_tokens) for r in Driver(spec).arrivals(36_000)]
    b = [(r.arrival_s, r.prompt_tokens, r.answer_tokens) for r in Driver(spec).arrivals(36_000)]
    c = [(r.arrival_s, r.prompt_tokens) for r in Driver(spec, seed=99).arrivals(36_000)]
    assert a == b
    assert 30 <= len(a) <= 90  # about 60 in ten hours
    assert [x[:2] for x in a] != c


def test_events_fire_once_in_time_order() -> None:
    spec = WorkloadSpec(
        name="e",
        phase=(PhaseSpec(kind="idle", duration_s=100.0),),
        event=(EventSpec(at_s=50.0, plugged=True), EventSpec(at_s=10.0, other_apps_mb=100.0)),
    )
    driver = Driver(spec)
    assert driver.events(5.0) == []
    assert [e.at_s for e in driver.events(60.0)] == [10.0, 50.0]
    assert driver.events(100.0) == []


def test_the_world_alone_asks_nothing_for_as_long_and_keeps_the_other_programs() -> None:
    busy = load_workload("busy-machine")
    alone = busy.without_questions()
    assert alone.duration_s == busy.duration_s
    assert alone.background_load == busy.background_load
    assert alone.event == busy.event
    driver = Driver(alone)
    assert [driver.arrivals(t) for t in (0.0, 600.0, busy.duration_s)] == [[], [], []]
