"""The daemon wakes at once on a real uevent (umockdev testbed), long before its next scheduled tick."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from governor.daemon.client import ControlClient
from policies import load_policy
from tests.governor.daemon.daemon_proc import TEST_POLICY
from tests.helpers import eventually
from tests.sensors.test_events import SYSTEM_PYTHON, umockdev_missing

pytestmark = pytest.mark.slow

LONG_TICK_S = 60.0  # nothing but a uevent can explain a reaction within a few seconds


def slow_policy() -> str:
    text = TEST_POLICY.replace("interval_s = 0.5", f"interval_s = {LONG_TICK_S}")
    text = text.replace("mitigating_interval_s = 0.25", f"mitigating_interval_s = {LONG_TICK_S}")
    text = text.replace("min_dwell_s = 0.5", "min_dwell_s = 0.0")
    return text.replace(
        "[battery]\nlow_percent = 20.0\nenter_debounce_s = 0.25",
        "[battery]\nlow_percent = 20.0\nenter_debounce_s = 0.0",
    )


def test_pulling_the_charger_is_seen_at_once(tmp_path: Path, sock_dir: Path, demo_ladder: Path) -> None:
    reason = umockdev_missing()
    if reason is not None:
        pytest.skip(reason)
    policy = tmp_path / "policy.toml"
    policy.write_text(slow_policy())
    loaded = load_policy(policy)
    assert loaded.timing.interval_s == loaded.timing.mitigating_interval_s == LONG_TICK_S  # the edit took
    assert loaded.battery.enter_debounce_s == 0.0
    control = sock_dir / "c.sock"
    argv = [
        sys.executable, "-m", "governor", "--log-json", "run", "--root", "@ROOT@", "--policy", str(policy),
        "--models", str(demo_ladder), "--control-socket", str(control), "--engine-socket", str(sock_dir / "e.sock"),
        "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    driver_argv = [SYSTEM_PYTHON, str(Path(__file__).with_name("udev_daemon_driver.py")), str(tmp_path / "log"), *argv]
    env = {**os.environ, "LD_PRELOAD": "libumockdev-preload.so.0"}
    with subprocess.Popen(driver_argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as driver:
        assert driver.stdin is not None
        assert driver.stdout is not None
        try:
            assert driver.stdout.readline().startswith("root ")
            client = ControlClient(control)

            def status() -> dict[str, Any]:
                assert control.exists(), (tmp_path / "log").read_text()[-3000:]
                answer: dict[str, Any] = client.request("status")["status"]
                return answer

            eventually(lambda: status()["ticks"] >= 1 and status()["engine"], timeout_s=90)
            assert status()["state"] == "idle"
            ticks = status()["ticks"]
            pulled = time.monotonic()
            driver.stdin.write("pull\n")
            driver.stdin.flush()
            assert driver.stdout.readline().strip() == "pulled"
            eventually(lambda: status()["state"] == "low_battery", timeout_s=10)
            assert time.monotonic() - pulled < LONG_TICK_S / 4
            assert status()["ticks"] <= ticks + 3  # woken, not polled
        finally:
            driver.stdin.write("quit\n")
            driver.stdin.flush()
            driver.wait(90)
