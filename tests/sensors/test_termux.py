"""termux-battery-status through fake scripts that print JSON, print garbage, fail, or hang."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sensors.sampler import SensorSampler, make_sampler
from sensors.snapshot import Battery, Problem, Snapshot, Temperature
from sensors.termux import TermuxBattery, termux_detected
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

STATUS = {
    "present": True,
    "technology": "Li-ion",
    "health": "GOOD",
    "plugged": "PLUGGED_USB",
    "status": "CHARGING",
    "temperature": 31.4,
    "voltage": 4123,
    "current": -350000,
    "current_average": -340000,
    "percentage": 76,
    "level": 76,
    "scale": 100,
    "charge_counter": 3_200_000,
    "energy": None,
    "cycle": 211,
}


def script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return [str(path)]


def printing(tmp_path: Path, payload: object) -> list[str]:
    return script(tmp_path, "status-json", f"cat <<'EOF'\n{json.dumps(payload, indent=2)}\nEOF\n")


@pytest.fixture
def pollers() -> Iterator[list[TermuxBattery]]:
    made: list[TermuxBattery] = []
    yield made
    for poller in made:
        poller.close()


def poller(pollers: list[TermuxBattery], command: list[str], **kwargs: Any) -> TermuxBattery:
    made = TermuxBattery(command, **kwargs)
    pollers.append(made)
    made.start()
    return made


def good(termux: TermuxBattery) -> tuple[Battery, list[Problem]]:
    battery, problems = termux.latest()
    assert battery is not None
    return battery, problems


def test_json_becomes_a_battery_with_its_age(tmp_path: Path, pollers: list[TermuxBattery]) -> None:
    termux = poller(pollers, printing(tmp_path, STATUS))
    battery, problems = eventually(lambda: good(termux))
    assert problems == []
    assert battery is not None
    assert battery.age_s is not None
    assert battery.age_s >= 0
    assert battery.power_w == pytest.approx(0.35 * 4.123)  # |µA| x mV
    assert battery.model_copy(update={"age_s": None, "power_w": None}) == Battery(
        percent=76.0, charging=True, plugged=True, power_w=None, temp_c=31.4, source="termux"
    )


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("echo 'oops not json'\n", "not JSON: 'oops not json'"),
        ('echo \'{"percentage": "lots"}\'\n', "unexpected JSON at percentage: Input should be a valid number"),
        ("echo 'Termux:API is not installed' >&2; exit 1\n", "exit status 1: Termux:API is not installed"),
    ],
)
def test_bad_output_is_a_problem_not_a_reading(
    tmp_path: Path, pollers: list[TermuxBattery], body: str, reason: str
) -> None:
    termux = poller(pollers, script(tmp_path, "status-bad", body))
    eventually(lambda: termux.runs >= 1)
    battery, problems = termux.latest()
    assert battery is None
    assert [(p.path, p.reason[: len(reason)]) for p in problems] == [("status-bad", reason)]


def test_missing_command(pollers: list[TermuxBattery], tmp_path: Path) -> None:
    termux = poller(pollers, [str(tmp_path / "termux-battery-status")])
    eventually(lambda: termux.runs >= 1)
    assert [p.reason for p in termux.latest()[1]] == [
        f"cannot run {tmp_path / 'termux-battery-status'}: No such file or directory"
    ]


def test_a_hanging_command_times_out_and_its_processes_die(tmp_path: Path, pollers: list[TermuxBattery]) -> None:
    pid_file = tmp_path / "pid"
    command = [*script(tmp_path, "status-hang", 'echo $$ > "$1"\nsleep 60\necho never\n'), str(pid_file)]
    termux = poller(pollers, command, timeout_s=1.0, refresh_s=60)
    assert termux.latest() == (None, [])  # nothing yet, and the caller did not wait for the command
    eventually(lambda: termux.runs >= 1)
    assert [p.reason for p in termux.latest()[1]] == ["timed out after 1 s"]
    group = int(pid_file.read_text())

    def group_gone() -> bool:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        return False

    eventually(group_gone)  # the shell and its sleep were killed together


def test_last_good_result_is_served_after_a_failure_until_stale(tmp_path: Path, pollers: list[TermuxBattery]) -> None:
    now = [100.0]
    counter = tmp_path / "count"
    body = (
        f'if [ -e "{counter}" ]; then echo garbage; exit 0; fi\ntouch "{counter}"\n'
        f"cat <<'EOF'\n{json.dumps(STATUS)}\nEOF\n"
    )
    termux = poller(
        pollers, script(tmp_path, "status-flaky", body), refresh_s=0.01, max_age_s=60, monotonic=lambda: now[0]
    )
    eventually(lambda: termux.runs >= 2)
    now[0] += 30
    battery, problems = termux.latest()
    assert battery is not None
    assert (battery.percent, battery.age_s) == (76.0, 30.0)
    assert [p.reason for p in problems] == ["not JSON: 'garbage'"]
    now[0] += 31
    battery, problems = termux.latest()
    assert battery is None
    assert [p.reason for p in problems] == ["not JSON: 'garbage'", "stale: last good result is 61 s old"]


def test_absurd_battery_temperature_is_dropped_and_reported(tmp_path: Path, pollers: list[TermuxBattery]) -> None:
    termux = poller(pollers, printing(tmp_path, {**STATUS, "temperature": 400.0}))
    battery, problems = eventually(lambda: good(termux))
    assert battery is not None
    assert battery.temp_c is None
    assert [p.reason for p in problems] == ["absurd: temperature 400 °C is outside -40..150 °C"]


def test_sampler_uses_termux_when_sysfs_has_no_battery(tree: FakeTree, tmp_path: Path) -> None:
    tree.meminfo()
    with SensorSampler(tree.root, termux_cmd=printing(tmp_path, STATUS), cpu_util=None) as sampler:

        def with_battery() -> Snapshot:
            snapshot = sampler.sample()
            assert snapshot.battery is not None
            return snapshot

        snapshot = eventually(with_battery)
        assert snapshot.battery is not None
        assert snapshot.battery.source == "termux"
        # No thermal zone is readable: the battery's temperature is the thermal signal of last resort.
        assert snapshot.temperatures == (Temperature(source="termux", kind="battery", label="battery", temp_c=31.4),)
        assert any("in the background" in note for note in sampler.notes())


def test_sysfs_battery_wins_and_termux_is_never_run(tree: FakeTree, tmp_path: Path) -> None:
    tree.battery("battery", temp=300)
    with SensorSampler(tree.root, termux_cmd=printing(tmp_path, STATUS), cpu_util=None) as sampler:
        battery = sampler.sample().battery
        assert battery is not None
        assert battery.source == "sysfs:battery"
        assert sampler.termux is not None
        assert sampler.termux.runs == 0


@pytest.mark.parametrize(
    ("environ", "detected"),
    [
        ({"TERMUX_VERSION": "0.118.1"}, True),
        ({"PREFIX": "/data/data/com.termux/files/usr"}, True),
        ({"PREFIX": "/usr/local"}, False),
        ({}, False),
    ],
)
def test_termux_detection(environ: dict[str, str], detected: bool, tree: FakeTree) -> None:
    assert termux_detected(environ) is detected
    tree.root.mkdir(parents=True)
    sampler = make_sampler(tree.root, environ=environ)
    assert isinstance(sampler, SensorSampler)
    assert (sampler.termux.command if sampler.termux else None) == (["termux-battery-status"] if detected else None)
    sampler.close()
