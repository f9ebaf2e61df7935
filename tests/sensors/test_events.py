"""udev events: real uevents through an umockdev testbed, and the polling fallback where udev does not run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from sensors.events import UdevEvents, udev_running

HERE = Path(__file__).parent
SYSTEM_PYTHON = "/usr/bin/python3"


def umockdev_missing() -> str | None:
    """Why the umockdev test cannot run here, or None when it can."""
    if shutil.which("umockdev-wrapper") is None:
        return "umockdev is not installed (apt-get install umockdev gir1.2-umockdev-1.0)"
    probe = "import gi; gi.require_version('UMockdev', '1.0'); from gi.repository import UMockdev"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} is absent (the driver needs Debian's python3-gi)"
    done = subprocess.run([SYSTEM_PYTHON, "-c", probe], capture_output=True, check=False)
    if done.returncode != 0:
        return "the UMockdev GObject bindings are missing (apt-get install gir1.2-umockdev-1.0 python3-gi)"
    return None


def test_real_uevents_reach_the_callback_filtered_by_subsystem() -> None:
    reason = umockdev_missing()
    if reason is not None:
        pytest.skip(reason)
    done = subprocess.run(
        [SYSTEM_PYTHON, str(HERE / "udev_driver.py"), sys.executable, str(HERE / "udev_child.py")],
        env={**os.environ, "LD_PRELOAD": "libumockdev-preload.so.0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # The input device's event was filtered out; the thermal event arrived although the first callback raised.
    assert done.stdout.splitlines() == ["ready", "event change power_supply AC", "event change thermal thermal_zone0"]
    logged = [json.loads(line)["event"] for line in done.stderr.splitlines() if line.startswith("{")]
    assert logged == ["udev_events", "udev_callback_failed"]


def test_without_udev_it_says_so_once_and_polling_goes_on(
    tmp_path: Path, captured_logs: list[structlog.typing.EventDict]
) -> None:
    control = str(tmp_path / "run/udev/control")
    events = UdevEvents(lambda _event: None, control=control, environ={})
    assert events.start() is False
    assert events.active is False
    assert captured_logs == [
        {
            "event": "udev_unavailable",
            "reason": f"udev is not running ({control} is absent)",
            "fallback": "polling",
            "log_level": "info",
        }
    ]
    events.stop()  # harmless when nothing was started


def test_udev_is_running_when_its_control_socket_exists_or_under_umockdev(tmp_path: Path) -> None:
    control = tmp_path / "control"
    assert udev_running(str(control), {}) is False
    assert udev_running(str(control), {"UMOCKDEV_DIR": str(tmp_path)}) is True
    control.touch()
    assert udev_running(str(control), {}) is True
