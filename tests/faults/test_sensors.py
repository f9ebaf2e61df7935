"""Sensor garbage in the only (trusted) thermal zone: the real sampler names the broken or vanished sensor in
`problems` on every sample, and the real policy turns conservative after its grace: hot limits, with the reason
"no trustworthy temperature". One case runs end to end on the victim daemon."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from policies.decision import State
from policies.loader import load_policy, parse_policy
from policies.machine import StateMachine
from sensors.sampler import SensorSampler
from sensors.snapshot import EngineObservation
from tests.faults.conftest import FAULT_POLICY
from tests.governor.daemon.daemon_proc import DaemonProc, device_tree
from tests.helpers import eventually

FAULT_KIND = "sensor garbage"
ZONE = "sys/class/thermal/thermal_zone0"
IDLE = EngineObservation(busy=False)


def text(value: bytes) -> Callable[[Path], None]:
    def write(temp: Path) -> None:
        temp.write_bytes(value)

    return write


def fifo(temp: Path) -> None:
    temp.unlink()
    os.mkfifo(temp)


def directory(temp: Path) -> None:
    temp.unlink()
    temp.mkdir()


def zone_gone(temp: Path) -> None:
    link = temp.parent
    shutil.rmtree(link.resolve())
    link.unlink()


def symlink_loop(temp: Path) -> None:
    temp.unlink()
    temp.symlink_to(temp)


CASES: list[tuple[str, Callable[[Path], None]]] = [
    ("letters", text(b"abc\n")),
    ("empty", text(b"")),
    ("whitespace", text(b"  \n\n")),
    ("nan", text(b"nan\n")),
    ("inf", text(b"inf\n")),
    ("1e400", text(b"1e400\n")),
    ("absolute zero -273150", text(b"-273150\n")),
    ("1000000000", text(b"1000000000\n")),
    ("two numbers", text(b"42000 43000\n")),
    ("hex", text(b"0x1F\n")),
    ("binary", text(b"\x00\x01\x02\xff")),
    ("invalid UTF-8", text(b"4\xff2000\n")),
    ("1 MB of digits", text(b"9" * (1 << 20))),
    ("temp deleted", lambda temp: temp.unlink()),
    ("temp a directory", directory),
    ("temp a FIFO", fifo),
    ("temp a symlink loop", symlink_loop),
    ("zone deleted", zone_gone),
]


@pytest.mark.parametrize("break_it", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_sensor_garbage_is_named_and_turns_the_policy_conservative(
    tmp_path: Path, break_it: Callable[[Path], None]
) -> None:
    tree = device_tree(tmp_path)
    sampler = SensorSampler(tree.root, cpu_util=None, rediscover_s=0.0)
    policy = parse_policy(FAULT_POLICY, "fault.toml")
    governor = StateMachine(policy)
    assert governor.decide(sampler.sample(), IDLE, 0.0).state == State.IDLE
    break_it(tree.path(f"{ZONE}/temp"))
    for tick in range(1, 8):  # past the grace (0.5 s) and the enter debounce, at 0.25 s per tick
        snapshot = sampler.sample()
        assert any(p.path.startswith(f"/{ZONE}") for p in snapshot.problems), snapshot.problems  # named every tick
        decision = governor.decide(snapshot, IDLE, tick * 0.25)
    assert decision.state == State.HOT
    assert decision.rule == "thermal.untrusted"
    assert "no trustworthy temperature" in decision.reason
    hot = policy.states[State.HOT]
    assert decision.engine.threads <= hot.thread_limit
    assert decision.engine.max_tokens_per_s is not None
    assert decision.engine.max_tokens_per_s <= (hot.max_tokens_per_s or 0)


@pytest.mark.slow
def test_garbage_on_the_running_daemon_is_reported_and_conservative(victim: DaemonProc) -> None:
    temp = victim.tree.path(f"{ZONE}/temp")
    temp.write_text("abc\n")
    try:
        status = eventually(lambda: (s := victim.status())["state"] == "hot" and s, timeout_s=20)
        assert "no trustworthy temperature" in status["reason"]
        problems = status["readings"]["problems"]
        assert any(p["path"] == f"/{ZONE}/temp" and "not a number" in p["reason"] for p in problems), problems
        eventually(lambda: victim.engine_threads() <= 2, timeout_s=20)
    finally:
        temp.write_text("45000\n")
    eventually(lambda: victim.status()["readings"]["problems"] == [], timeout_s=20)


@pytest.mark.parametrize("profile", ["default", "raspberry-pi", "fanless-laptop"])  # android-termux trusts skin zones
def test_an_unreadable_only_zone_applies_real_limits_with_each_shipped_profile(tmp_path: Path, profile: str) -> None:
    """Issue 33: with `default` or `raspberry-pi` the untrusted rule said hot but left 4 threads, no rate cap and the
    full clock -- the same as idle. Now: the hot profile's floor."""
    tree = device_tree(tmp_path)
    sampler = SensorSampler(tree.root, cpu_util=None, rediscover_s=0.0)
    policy = load_policy(profile)
    governor = StateMachine(policy, freq_ratios=(0.5, 0.75, 1.0))
    idle = governor.decide(sampler.sample(), IDLE, 0.0)
    tree.path(f"{ZONE}/temp").write_text("abc\n")
    t, step = 0.0, policy.timing.mitigating_interval_s
    while t < policy.thermal.untrusted_grace_s + policy.timing.min_dwell_s + 5:
        t += step
        decision = governor.decide(sampler.sample(), IDLE, t)
    assert decision.rule == "thermal.untrusted", decision.reason
    hot = policy.states[State.HOT]
    assert decision.engine.threads == (hot.min_threads or 1) < idle.engine.threads
    assert decision.engine.max_tokens_per_s is not None
    assert decision.engine.max_tokens_per_s <= (hot.min_tokens_per_s or hot.max_tokens_per_s or 0)
    assert decision.freq_ratio is None or decision.freq_ratio < 1.0
