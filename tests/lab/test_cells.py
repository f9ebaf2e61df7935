"""Issue 10's cells beside other processes' work (docs/lab.md, "Left, with why"), run as the grid runs them."""

from __future__ import annotations

from functools import cache

import pytest

from governor.lab.catalog import load_device
from governor.lab.deciders import NONE, Ungoverned, decider_for, load_policy
from governor.lab.experiment import Summary, simulate
from governor.lab.workload import load_workload


@cache
def cell(device_name: str, policy_name: str, workload_name: str) -> Summary:
    device, workload = load_device(device_name), load_workload(workload_name)
    decider = Ungoverned(device) if policy_name == NONE else decider_for(load_policy(policy_name), device)
    return simulate(device, decider, workload, policy_name=policy_name).summary


@pytest.mark.slow
@pytest.mark.parametrize("policy_name", ["raspberry-pi", "default"])
@pytest.mark.parametrize("workload_name", ["background-load", "busy-machine"])
def test_beside_other_work_the_compute_bound_board_never_reaches_its_trip(policy_name: str, workload_name: str) -> None:
    """The pi4 board at its setpoint, 0.5 °C under the trip: a prompt (beside a hog) or the end of a build heated
    the die past the trip before the PI cut a clock step (80.03-80.04 °C; after the build 0.9 % throttled); the trip
    guard steps the clock first. A build no longer costs tokens or joules there either (0.994 and 1.005 x none)."""
    governed, ungoverned = (
        cell("pi4-closed-case", policy_name, workload_name),
        cell("pi4-closed-case", NONE, workload_name),
    )
    assert ungoverned.peak_c > ungoverned.trip_c  # the kernel throttles ungoverned: there is heat to keep off
    assert governed.peak_c < governed.trip_c
    assert governed.throttled_pct == 0.0
    assert governed.tokens >= ungoverned.tokens
    assert governed.j_per_token is not None
    assert ungoverned.j_per_token is not None
    assert governed.j_per_token <= ungoverned.j_per_token


@pytest.mark.slow
def test_default_beside_a_hog_keeps_the_phones_skin_under_its_trip() -> None:
    """With a 2 tok/s floor the PI sat at its floor from 525 s and the skin still reached 43 °C at 705 s; the vendor's
    throttling then held 30 % of the run (its 5 °C hysteresis)."""
    governed, ungoverned = cell("phone", "default", "background-load"), cell("phone", NONE, "background-load")
    assert governed.throttled_pct <= 2.0
    assert governed.peak_c <= governed.trip_c
    assert governed.tokens >= 1.2 * ungoverned.tokens


@pytest.mark.slow
def test_a_build_alone_throttles_the_phone() -> None:
    """busy-machine on the phone is bounded by the world: with no questions at all the build takes the skin past
    its trip (so no engine setting can keep it under)."""
    device, alone = load_device("phone"), load_workload("busy-machine").without_questions()
    s = simulate(device, Ungoverned(device), alone, policy_name=NONE).summary
    assert s.tokens == 0
    assert s.peak_c > s.trip_c
    assert s.throttled_pct > 40.0


@pytest.mark.slow
def test_a_tier_change_does_not_leave_the_clock_chasing_another_models_ceiling() -> None:
    """The N100 under a memory squeeze: the 3B tier's per-thread speed, kept for the 8B model, had the allocator pick
    3 threads at 29 % clock at 62 °C (0.937 x none); the speed figures are now the model's."""
    governed = cell("n100-fanless-8b", "fanless-laptop", "memory-squeeze-1g")
    ungoverned = cell("n100-fanless-8b", NONE, "memory-squeeze-1g")
    assert governed.tokens >= 0.99 * ungoverned.tokens
    assert governed.oom_kills == 0
    # The rest of `none`'s lead is answers the kernel killed mid-stream: streamed, then an error; the governed run
    # completed more answers and lost none.
    assert ungoverned.lost_tokens > ungoverned.tokens - governed.tokens
    assert governed.lost_tokens == 0
    assert governed.answers > ungoverned.answers


@pytest.mark.slow
@pytest.mark.parametrize("device_name", ["fanless-laptop", "n100-fanless-8b"])
def test_beside_a_build_the_memory_bound_devices_lose_neither_tokens_nor_joules(device_name: str) -> None:
    """A build beside the chat: on the laptop the governed run held 94.5 °C at the top clock (the budget did not
    bind and, contended, the model could not learn that decode gains nothing from it) where `none` ran at the kernel's
    93 %: the same tokens for the build's extra watts (1.004x the J/token); and the last prompt started at the 80 %
    clock chosen for decoding at the memory ceiling, 6 tokens short at the run's end."""
    governed, ungoverned = cell(device_name, "default", "busy-machine"), cell(device_name, NONE, "busy-machine")
    assert governed.tokens >= ungoverned.tokens
    assert governed.j_per_token is not None
    assert ungoverned.j_per_token is not None
    assert governed.j_per_token < ungoverned.j_per_token
    assert governed.throttled_pct == 0.0


@pytest.mark.slow
def test_beside_a_build_the_pi5_prompts_are_not_cut_under_the_setpoint() -> None:
    """The Pi 5 under `default` beside a build made 2,183 of `none`'s 2,184 tokens: back under the setpoint after a
    hot spell the PI's output fell below 1 as the die approached it again and cut the prompts' clock (0.1-0.2 s of
    time to first token each), where `none` ran them at the top clock and was throttled in the decode, at the memory
    ceiling, where it costs nothing. With the change price and the contention bans (issue 27) it makes 2,182: the
    last answer's end falls 2 tokens after the run's (0.999 x; J/token and throttling below none's)."""
    governed, ungoverned = (
        cell("raspberry-pi-5", "default", "busy-machine"),
        cell("raspberry-pi-5", NONE, "busy-machine"),
    )
    assert governed.tokens >= 0.998 * ungoverned.tokens
    assert governed.j_per_token is not None
    assert ungoverned.j_per_token is not None
    assert governed.j_per_token <= ungoverned.j_per_token
    assert governed.peak_c < governed.trip_c
    assert governed.throttled_pct == 0.0


@pytest.mark.slow
def test_a_phone_whose_clock_termux_cannot_set_keeps_its_skin_on_the_little_cores_and_beats_ungoverned() -> None:
    """Issue 27's randomized phone (2 big + 6 little cores, skin trip 41.8 °C): hot held the skin with one big thread
    under a 1 tok/s cap, 0.57 x the ungoverned engine's tokens at 1.6 x its J/token, where the kernel's own throttling
    (63.6 % of the run) lowered the clock, f^2.5 cheaper. The same watts on the little cores give the ungoverned
    engine's tokens (every answer of the chat) at 0.91 x its J/token, with no throttling."""
    governed, ungoverned = (
        cell("fleet:2:0:phone", "default", "long-chat"),
        cell("fleet:2:0:phone", NONE, "long-chat"),
    )
    assert ungoverned.throttled_pct > 50
    assert governed.throttled_pct == 0.0
    assert governed.tokens >= ungoverned.tokens
    assert governed.j_per_token is not None
    assert ungoverned.j_per_token is not None
    assert governed.j_per_token <= 0.95 * ungoverned.j_per_token


@pytest.mark.slow
def test_a_board_whose_clock_cannot_be_set_leaves_its_trip_to_the_kernels_clock_steps() -> None:
    """Issue 27's randomized board (8 alike cores, trip 70 °C, no writable clock): hot held the zone under its setpoint
    with threads and a rate cap at the full clock, 0.55 x the ungoverned engine's tokens at 1.6 x its J/token over a
    long chat and 8.6 config changes a minute. The kernel's lower clock on every thread costs f^2.5 of the watts for f
    of the speed: hot yields to it, and the run is the ungoverned engine's, throttled as it is."""
    governed, ungoverned = cell("fleet:2:158", "default", "long-chat"), cell("fleet:2:158", NONE, "long-chat")
    assert governed.tokens >= 0.97 * ungoverned.tokens
    assert governed.j_per_token is not None
    assert ungoverned.j_per_token is not None
    assert governed.j_per_token <= 1.02 * ungoverned.j_per_token
    assert governed.config_changes <= 2 * governed.minutes
