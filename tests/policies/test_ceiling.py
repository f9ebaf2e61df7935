"""No limit cycle in hot (policies/ceiling.py): a thread count hot had to cut again soon after rising to it, with the
zone over the setpoint, waits a back-off that doubles; a rise that held for longer is no cycle."""

from __future__ import annotations

from policies import StateMachine
from policies.ceiling import BACKOFF_MAX_S, BACKOFF_S, RECENT_S, Ceiling
from policies.decision import Decision, State
from tests.policies.builders import BUSY
from tests.policies.test_authority import POLICY, hot_snap  # no writable clock: hot's PI places threads and rate


def play(gov: StateMachine, temps: list[float], t0: float = 0.0) -> list[Decision]:
    return [gov.decide(hot_snap(c, throttled=False), BUSY, t0 + i) for i, c in enumerate(temps)]


def test_a_count_cut_again_soon_after_coming_back_waits_while_the_zone_is_under_the_setpoint() -> None:
    gov = StateMachine(POLICY)  # hot from 75 °C, setpoint 78 °C: at 76 °C the PI comes back up to 3 threads
    out = play(gov, [77.0] * 40 + [79.5] * 20 + [76.0] * 30 + [79.5] * 20 + [76.0] * 60)
    assert out[59].engine.threads == 1  # cut for heat
    assert out[89].engine.threads == 3  # back (not a cycle yet: nothing came back before)
    assert out[109].engine.threads == 1  # cut again within RECENT_S of the rise to 3 threads: a cycle
    after = out[110:]
    assert max(d.engine.threads for d in after) == 2  # the PI is back at 1.0, but 3 threads wait
    assert after[-1].rule == "thermal.ceiling"
    assert "no limit cycle" in after[-1].reason
    assert "2 threads at most" in after[-1].reason
    later = play(gov, [76.0] * int(BACKOFF_S), t0=170.0)
    assert later[-1].engine.threads == 3  # the back-off over: tried again (a world that cooled gets it back)
    assert later[-1].rule == "thermal.pi"


def test_a_rise_that_held_longer_than_a_cycle_is_no_cycle() -> None:
    gov = StateMachine(POLICY)
    out = play(gov, [77.0] * 40 + [79.5] * 20 + [76.0] * int(RECENT_S + 30) + [79.5] * 20 + [76.0] * 30)
    assert out[-1].engine.threads == 3
    assert all(d.rule != "thermal.ceiling" for d in out)


def test_the_backoff_doubles_at_each_repeat_and_starts_over_after_a_quiet_spell() -> None:
    c = Ceiling()

    def cycle(t: float) -> None:
        c.observe(t, 1, over_setpoint=False)
        c.observe(t + 1, 2, over_setpoint=False)  # a rise ...
        c.asked(1)
        c.observe(t + 10, 1, over_setpoint=True)  # ... hot cut again within RECENT_S, the zone over the setpoint

    cycle(0.0)
    assert c.limit(11.0) == 1
    assert c.limit(10.0 + BACKOFF_S) is None
    cycle(200.0)
    assert c.limit(209.0 + 2 * BACKOFF_S) == 1  # doubled
    assert c.limit(210.0 + 2 * BACKOFF_S) is None
    cycle(500.0 + 2 * BACKOFF_S + BACKOFF_MAX_S)  # quiet for longer than the longest back-off: from the start
    assert c.until == 510.0 + 2 * BACKOFF_S + BACKOFF_MAX_S + BACKOFF_S
    c.observe(2000.0, 2, over_setpoint=True)  # a cut hot did not ask for (none asked) is no cycle
    c.asked(None)
    c.observe(2001.0, 1, over_setpoint=True)
    assert c.until < 2000.0


def test_the_ceiling_holds_when_the_zone_falls_out_of_hot() -> None:
    gov = StateMachine(POLICY)
    play(gov, [77.0] * 40 + [79.5] * 20 + [76.0] * 30 + [79.5] * 20)  # a cycle: 3 threads over the ceiling
    out = play(gov, [65.0] * 60, t0=110.0)  # under the hot exit: sustained ramps back, but not into the cycle
    assert out[-1].state == State.SUSTAINED
    assert max(d.engine.threads for d in out) == 2
    later = play(gov, [65.0] * int(BACKOFF_S), t0=170.0)
    assert later[-1].engine.threads == 4  # the back-off over: sustained's own count
