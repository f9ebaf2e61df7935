"""Every fault becomes None for that reading plus a Problem naming the path and the reason; sample() never raises."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from sensors.root import Root
from sensors.sampler import SensorSampler
from sensors.snapshot import Problem, Snapshot
from tests.sensors.tree import FakeTree


class FaultyRoot(Root):
    """Raises the OSError a real kernel (or SELinux) would, for the chosen kernel paths; reads the rest."""

    def __init__(self, prefix: Path, faults: Mapping[str, int]) -> None:
        super().__init__(prefix)
        self.faults = {self.path(rel): code for rel, code in faults.items()}

    def _check(self, path: str) -> None:
        code = self.faults.get(path)
        if code is not None:
            raise OSError(code, os.strerror(code), path)

    def read(self, path: str) -> bytes:
        self._check(path)
        return super().read(path)

    def listdir(self, path: str) -> list[str]:
        self._check(path)
        return super().listdir(path)


def problems(snapshot: Snapshot) -> list[tuple[str, str]]:
    return [(p.path, p.reason) for p in snapshot.problems]


def sample(tree: FakeTree, faults: Mapping[str, int] | None = None) -> Snapshot:
    root = FaultyRoot(tree.root, faults or {})
    return SensorSampler(root, cpu_util=None).sample()


def test_eio_costs_one_reading(tree: FakeTree) -> None:
    tree.laptop()
    snapshot = sample(tree, {"sys/class/thermal/thermal_zone0/temp": errno.EIO})
    assert [t.temp_c for t in snapshot.temperatures] == [None, 48.0, 53.0]
    assert problems(snapshot) == [("/sys/class/thermal/thermal_zone0/temp", "EIO: Input/output error")]
    assert snapshot.battery is not None
    assert snapshot.battery.percent == 87.0


def test_eacces_on_a_battery_file_and_on_a_selinux_denied_directory(tree: FakeTree) -> None:
    tree.laptop()
    snapshot = sample(tree, {"sys/class/power_supply/BAT0/status": errno.EACCES})
    assert snapshot.battery is not None
    assert (snapshot.battery.charging, snapshot.battery.plugged, snapshot.battery.percent) == (None, False, 87.0)
    assert problems(snapshot) == [
        ("/sys/class/power_supply/BAT0/status", "EACCES: Permission denied; left out until the next discovery")
    ]

    snapshot = sample(tree, {"sys/class/thermal": errno.EACCES})
    assert [t.source for t in snapshot.temperatures] == ["hwmon0/temp1"]
    assert problems(snapshot) == [("/sys/class/thermal", "EACCES: Permission denied")]


def test_hwmon_sensor_not_ready_enodata(tree: FakeTree) -> None:
    tree.hwmon(0, "nct6775", {1: {"input": 40000}, 2: {"input": 41000}})
    snapshot = sample(tree, {"sys/class/hwmon/hwmon0/temp2_input": errno.ENODATA})
    assert [t.temp_c for t in snapshot.temperatures] == [40.0, None]
    assert problems(snapshot) == [("/sys/class/hwmon/hwmon0/temp2_input", "ENODATA: No data available")]


def test_a_directory_where_a_file_should_be_gives_a_real_eisdir(tree: FakeTree) -> None:
    tree.thermal_zone(0)
    temp = tree.path("sys/class/thermal/thermal_zone0/temp")
    temp.unlink()
    temp.mkdir()
    snapshot = SensorSampler(tree.root, cpu_util=None).sample()
    assert snapshot.temperatures[0].temp_c is None
    assert problems(snapshot) == [("/sys/class/thermal/thermal_zone0/temp", "EISDIR: Is a directory")]


def test_a_vanished_sensor_stays_unknown_and_named(tree: FakeTree) -> None:
    """Rediscovered after it vanished, but never silently dropped: a governor must not lose sight of a zone."""
    tree.thermal_zone(0)
    tree.thermal_zone(1)
    sampler = SensorSampler(tree.root, cpu_util=None, rediscover_s=3600)
    assert len(sampler.sample().temperatures) == 2
    tree.remove("sys/class/thermal/thermal_zone1")
    snapshot = sampler.sample()
    assert [t.temp_c for t in snapshot.temperatures] == [45.0, None]
    assert problems(snapshot) == [
        ("/sys/class/thermal/thermal_zone1/temp", "vanished: no such file (rediscovering)"),
    ]
    for _ in range(2):
        snapshot = sampler.sample()
        assert [(t.source, t.temp_c) for t in snapshot.temperatures] == [
            ("thermal_zone0", 45.0),
            ("thermal_zone1", None),
        ]
        assert problems(snapshot) == [("/sys/class/thermal/thermal_zone1/temp", "vanished: no longer readable")]


def test_new_devices_appear_after_the_rediscovery_period(tree: FakeTree) -> None:
    now = [0.0]
    tree.thermal_zone(0)
    sampler = SensorSampler(tree.root, cpu_util=None, rediscover_s=30, monotonic=lambda: now[0])
    sampler.sample()
    tree.battery("BAT0")
    assert sampler.sample().battery is None
    now[0] = 31.0
    assert sampler.sample().battery is not None


@pytest.mark.parametrize(
    ("content", "reason"),
    [("", "empty"), ("\n", "empty"), ("N/A", "not a number: 'N/A'"), ("nan", "not a number: 'nan'")],
)
def test_empty_and_non_numeric_content(tree: FakeTree, content: str, reason: str) -> None:
    tree.thermal_zone(0, temp=content, trips=())
    tree.write("sys/class/thermal/thermal_zone0/temp", content, newline=False)
    snapshot = sample(tree)
    assert snapshot.temperatures[0].temp_c is None
    assert problems(snapshot) == [("/sys/class/thermal/thermal_zone0/temp", reason)]


@pytest.mark.parametrize(
    ("rel", "value", "reason"),
    [
        ("sys/class/thermal/thermal_zone0/temp", 200000, "absurd: 200 °C is outside -40..150 °C"),
        ("sys/class/thermal/thermal_zone0/temp", -55000, "absurd: -55 °C is outside -40..150 °C"),
        ("sys/class/hwmon/hwmon0/temp1_input", 255000, "absurd: 255 °C is outside -40..150 °C"),
        ("sys/class/power_supply/BAT0/temp", 2000, "absurd: 200 °C is outside -40..150 °C"),
        ("sys/class/power_supply/BAT0/capacity", 250, "absurd: 250 % is outside 0..100 %"),
    ],
)
def test_absurd_values(tree: FakeTree, rel: str, value: int, reason: str) -> None:
    tree.laptop()
    tree.write(rel, value)
    assert problems(sample(tree)) == [(f"/{rel}", reason)]


def test_a_stuck_temperature_while_others_move(tree: FakeTree) -> None:
    tree.thermal_zone(0, "cpu", 45000)
    tree.thermal_zone(1, "skin-therm", 137000)
    sampler = SensorSampler(tree.root, cpu_util=None, stuck_samples=5)
    snapshots = []
    for i in range(7):
        tree.write("sys/class/thermal/thermal_zone0/temp", 45000 + 100 * i)
        snapshots.append(sampler.sample())
    assert [s.temperatures[1].temp_c for s in snapshots] == [137.0] * 5 + [None, None]
    assert snapshots[5].problems == (
        Problem(
            path="/sys/class/thermal/thermal_zone1/temp",
            reason="stuck: 137 °C unchanged for 5 samples while others moved",
        ),
    )
    tree.write("sys/class/thermal/thermal_zone1/temp", 136000)
    assert sampler.sample().temperatures[1].temp_c == 136.0


def test_nothing_is_stuck_when_everything_is_still(tree: FakeTree) -> None:
    tree.thermal_zone(0, "cpu", 45000)
    tree.thermal_zone(1, "gpu", 41000)
    sampler = SensorSampler(tree.root, cpu_util=None, stuck_samples=3)
    for _ in range(6):
        snapshot = sampler.sample()
    assert snapshot.problems == ()
    assert [t.temp_c for t in snapshot.temperatures] == [45.0, 41.0]


_garbage = st.one_of(
    st.binary(max_size=24),
    st.sampled_from(["", "-", "1e999", "0x10", "9" * 40, "Charging", "-1", "0-", ",", "\x00"]),
)


@settings(max_examples=25)
@given(contents=st.lists(_garbage, min_size=40, max_size=40))
def test_any_file_content_gives_a_snapshot_never_an_exception(contents: list[bytes | str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tree = FakeTree(Path(tmp)).laptop()
        files = sorted(p for p in tree.root.rglob("*") if p.is_file())
        for path, content in zip(files, contents, strict=False):
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
        snapshot = SensorSampler(tree.root, cpu_util=lambda: 99.0).sample()
        # Handled where it happened, never by sample()'s last-resort catch (which would say "internal error").
        assert [p for p in snapshot.problems if p.path == "sensors"] == []
        Snapshot.model_validate_json(snapshot.model_dump_json())  # still a valid trace line


def test_selinux_denied_zones_are_reported_once_per_discovery_then_left_out(tree: FakeTree) -> None:
    for n in range(3):
        tree.thermal_zone(n, f"tsens_tz_sensor{n}", 40000 + n * 1000)
    root = FaultyRoot(tree.root, {f"sys/class/thermal/thermal_zone{n}/temp": errno.EACCES for n in (0, 2)})
    sampler = SensorSampler(root, cpu_util=None)
    assert "2 files not permitted to read (SELinux?): left out" in sampler.notes()
    first, second = sampler.sample(), sampler.sample()
    assert [t.source for t in first.temperatures] == ["thermal_zone1"]
    assert problems(first) == [
        (f"/sys/class/thermal/thermal_zone{n}/temp", "EACCES: Permission denied; left out until the next discovery")
        for n in (0, 2)
    ]
    assert [t.source for t in second.temperatures] == ["thermal_zone1"]
    assert second.problems == ()


def test_a_battery_selinux_hides_entirely_counts_as_no_battery(tree: FakeTree) -> None:
    path = tree.battery("battery", temp=300)
    files = [p.name for p in tree.path(path).iterdir() if p.name not in ("type", "present", "uevent")]
    root = FaultyRoot(tree.root, {f"{path}/{name}": errno.EACCES for name in files})
    sampler = SensorSampler(root, cpu_util=None)
    first = sampler.sample()
    assert first.battery is None
    assert sorted(p.path for p in first.problems) == sorted(f"/{path}/{name}" for name in files)
    assert sampler.sample().problems == ()


def test_eacces_after_discovery_is_reported_in_every_sample(tree: FakeTree) -> None:
    tree.laptop()
    root = FaultyRoot(tree.root, {})
    sampler = SensorSampler(root, cpu_util=None)
    assert sampler.sample().problems == ()
    root.faults[root.path("sys/class/hwmon/hwmon0/temp1_input")] = errno.EACCES
    for _ in range(2):
        snapshot = sampler.sample()
        assert snapshot.temperatures[2].temp_c is None
        assert problems(snapshot) == [("/sys/class/hwmon/hwmon0/temp1_input", "EACCES: Permission denied")]


class BrokenRoot(Root):
    """A defect, not a kernel fault: something raises that no reader expects."""

    def read(self, path: str) -> bytes:
        raise RuntimeError("a bug")


def test_an_unexpected_error_costs_one_sample_not_the_daemon(
    tree: FakeTree, captured_logs: list[structlog.typing.EventDict]
) -> None:
    tree.laptop()
    snapshot = SensorSampler(BrokenRoot(tree.root), cpu_util=None).sample()
    assert problems(snapshot) == [("sensors", "internal error: RuntimeError('a bug')")]
    assert [entry["event"] for entry in captured_logs] == ["sensor_sample_failed"]
