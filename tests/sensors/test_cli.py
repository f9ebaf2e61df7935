"""`governor sensors`: what a user sees, through governor.cli.main and once as a real process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from governor.cli import main
from sensors.snapshot import Snapshot
from tests.sensors.tree import FakeTree


def test_json_is_one_snapshot_per_line(tree: FakeTree, capsys: pytest.CaptureFixture[str]) -> None:
    tree.laptop()
    assert main(["sensors", "--root", str(tree.root), "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    snapshot = Snapshot.model_validate_json(lines[0])
    assert [t.label for t in snapshot.temperatures] == ["x86_pkg_temp", "acpitz", "coretemp/Package id 0"]
    raw = json.loads(lines[0])
    assert set(raw) >= {"temperatures", "battery", "memory", "cpu", "problems"}
    assert raw["temperatures"][0] == {
        "source": "thermal_zone0",
        "kind": "thermal_zone",
        "label": "x86_pkg_temp",
        "temp_c": 52.0,
        "trips": [{"type": "passive", "temp_c": 85.0}, {"type": "critical", "temp_c": 105.0}],
    }
    assert {k: raw["battery"][k] for k in ("percent", "charging", "plugged", "power_w", "temp_c", "source")} == {
        "percent": 87.0,
        "charging": False,
        "plugged": False,
        "power_w": 5.2,
        "temp_c": None,
        "source": "sysfs:BAT0",
    }
    assert raw["cpu"] == {
        "freq_ratio": 0.625, "throttled": False, "count": 4, "util_percent": None, "other_cores": None,
        "engine_cores": None, "run_queue": None, "psi_some_avg10": None, "psi_full_avg10": None, "clusters": [],
    }  # fmt: skip
    assert raw["memory"]["psi_some_avg10"] == 1.5
    assert raw["problems"] == []


def test_an_empty_machine_says_plainly_what_it_did_not_find(tree: FakeTree, capsys: pytest.CaptureFixture[str]) -> None:
    tree.write("sys/class/thermal/cooling_device0/type", "Processor")
    tree.path("sys/class/power_supply").mkdir(parents=True)
    tree.meminfo()
    assert main(["sensors", "--root", str(tree.root)]) == 0
    out = capsys.readouterr().out
    root = tree.root
    for line in (
        f"no thermal zones under {root}/sys/class/thermal",
        f"no hwmon ({root}/sys/class/hwmon is absent)",
        "no battery (no power_supply devices)",
        f"no CPU frequency (no cpufreq under {root}/sys/devices/system/cpu)",
        "temperatures: none readable",
        "battery: none",
        "problems: none",
    ):
        assert line in out.splitlines()


def test_table_shows_readings_and_problems(tree: FakeTree, capsys: pytest.CaptureFixture[str]) -> None:
    tree.laptop()
    tree.write("sys/class/thermal/thermal_zone1/temp", "N/A")
    assert main(["sensors", "--root", str(tree.root)]) == 0
    out = capsys.readouterr().out
    assert "x86_pkg_temp" in out
    assert "passive 85, critical 105" in out
    assert "battery: 87 %, not charging, on battery, power 5.20 W, temperature unknown (sysfs:BAT0)" in out
    assert "cpu: 4 CPUs, frequency 62 % of max, throttled: no, busy unknown; other processes unknown" in out
    assert "/sys/class/thermal/thermal_zone1/temp" in out
    assert "not a number: 'N/A'" in out


def test_termux_command_supplies_the_battery(
    tree: FakeTree, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree.meminfo()
    status = tmp_path / "fake-termux-battery-status"
    status.write_text('#!/bin/sh\necho \'{"percentage": 42, "status": "DISCHARGING", "plugged": "UNPLUGGED"}\'\n')
    status.chmod(0o755)
    assert main(["sensors", "--root", str(tree.root), "--json", "--termux-command", str(status)]) == 0
    battery = Snapshot.model_validate_json(capsys.readouterr().out).battery
    assert battery is not None
    assert (battery.source, battery.percent, battery.plugged) == ("termux", 42.0, False)


def test_watch_prints_one_line_per_interval(tree: FakeTree, capsys: pytest.CaptureFixture[str]) -> None:
    tree.laptop()
    argv = ["sensors", "--root", str(tree.root), "--json", "--watch", "--interval", "0.01", "--count", "3"]
    assert main(argv) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--root", "/nonexistent/root"], "governor: error: --root /nonexistent/root: no such directory"),
        (["--interval", "0"], "governor: error: --interval 0: must be more than 0 seconds"),
    ],
)
def test_bad_arguments_are_one_clear_line(
    tree: FakeTree, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    tree.root.mkdir(parents=True)
    assert main(["sensors", "--root", str(tree.root), *extra]) == 2
    assert capsys.readouterr().err.strip() == message


def test_as_a_real_process_and_ctrl_c_ends_watch_cleanly(tree: FakeTree) -> None:
    tree.laptop()
    once = subprocess.run(
        [sys.executable, "-m", "governor", "sensors", "--root", str(tree.root), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert Snapshot.model_validate_json(once.stdout).battery is not None
    watch = subprocess.Popen(
        [sys.executable, "-m", "governor", "sensors", "--root", str(tree.root), "--watch", "--interval", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert watch.stdout is not None
    assert watch.stdout.readline().startswith("2 thermal zones under")
    watch.send_signal(signal.SIGINT)
    _, err = watch.communicate(timeout=30)
    assert watch.returncode == 0
    assert "Traceback" not in err
