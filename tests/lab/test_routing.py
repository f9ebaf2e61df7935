"""The lab's upstream (issue 12): a hot phone's long chat, with and without a machine to route turns to."""

from __future__ import annotations

import pytest

from governor.lab.catalog import load_device
from governor.lab.deciders import decider_for, load_policy
from governor.lab.experiment import Summary, simulate
from governor.lab.workload import load_workload
from policies.schema import Slo

PHONE = load_device("phone")
MINUTES = 30.0  # the whole chat: the phone alone spends most of it hot


def run(workload: str, *, slo: Slo | None = None) -> Summary:
    policy = load_policy("android-termux")
    assert policy is not None
    if slo is not None:
        policy = policy.model_copy(update={"slo": slo})
    spec = load_workload(workload)
    return simulate(PHONE, decider_for(policy, PHONE), spec, policy_name="android-termux", minutes=MINUTES).summary


@pytest.fixture(scope="module")
def alone() -> Summary:
    return run("long-chat")


def test_a_hot_phone_with_an_upstream_delivers_more_sooner_and_cooler(alone: Summary) -> None:
    routed = run("long-chat-upstream")
    assert alone.state_pct.get("hot", 0) > 50
    assert alone.routed_answers == 0
    assert routed.routed_answers > 0
    assert routed.tokens > 1.3 * alone.tokens
    assert routed.ttft_p95_s is not None
    assert alone.ttft_p95_s is not None
    assert routed.ttft_p95_s < 0.5 * alone.ttft_p95_s
    assert routed.peak_c < alone.peak_c
    assert routed.energy_j < alone.energy_j


def test_without_targets_only_a_turn_the_engine_cannot_take_is_routed(alone: Summary) -> None:
    same = run("long-chat-upstream", slo=Slo())
    assert same.routed_answers == 1  # the first turn, while the phone loads its model (the daemon does the same)
    assert alone.ttft_p50_s is not None
    assert same.ttft_p50_s is not None
    assert same.ttft_p50_s == pytest.approx(alone.ttft_p50_s, rel=0.3)
