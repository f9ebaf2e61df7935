"""Thermal zones and hwmon chips on fake trees in kernel formats, including vendor kernels' units."""

from __future__ import annotations

import pytest

from sensors.sampler import SensorSampler
from sensors.snapshot import Snapshot, Temperature, Trip
from tests.sensors.tree import FakeTree


def sample(tree: FakeTree) -> Snapshot:
    return SensorSampler(tree.root, cpu_util=None).sample()


def by_source(snapshot: Snapshot) -> dict[str, Temperature]:
    return {t.source: t for t in snapshot.temperatures}


def test_thermal_zones_with_their_trip_points(tree: FakeTree) -> None:
    tree.thermal_zone(0, "cpu-thermal", 52312, trips=(("passive", 85000), ("critical", 105000)))
    tree.thermal_zone(1, "gpu-thermal", 40000, trips=())
    snapshot = sample(tree)
    assert snapshot.temperatures == (
        Temperature(
            source="thermal_zone0",
            kind="thermal_zone",
            label="cpu-thermal",
            temp_c=52.312,
            trips=(Trip(type="passive", temp_c=85.0), Trip(type="critical", temp_c=105.0)),
        ),
        Temperature(source="thermal_zone1", kind="thermal_zone", label="gpu-thermal", temp_c=40.0),
    )
    assert snapshot.problems == ()


def test_zones_sort_numerically_and_trips_in_order(tree: FakeTree) -> None:
    for n in (10, 2, 1):
        tree.thermal_zone(n, f"z{n}", 30000 + n * 1000)
    tree.thermal_zone(3, "many-trips", 30000, trips=tuple(("active", 40000 + i * 1000) for i in range(12)))
    temps = sample(tree).temperatures
    assert [t.source for t in temps] == ["thermal_zone1", "thermal_zone2", "thermal_zone3", "thermal_zone10"]
    assert [trip.temp_c for trip in temps[2].trips] == [40.0 + i for i in range(12)]


@pytest.mark.parametrize(
    ("written", "celsius"),
    [
        ("45000", 45.0),  # the ABI: millidegrees
        ("45", 45.0),  # BSP kernels writing °C
        ("452", 45.2),  # tenths
        ("33.25", 33.25),  # decimals
        ("-5000", -5.0),  # a cold outdoor box
        ("0", 0.0),
    ],
)
def test_vendor_units_are_normalised_on_magnitude(tree: FakeTree, written: str, celsius: float) -> None:
    tree.thermal_zone(0, "mtktscpu", written, trips=())
    assert sample(tree).temperatures[0].temp_c == pytest.approx(celsius)


def test_disabled_zone_is_skipped_and_disabled_trips_dropped(tree: FakeTree) -> None:
    tree.thermal_zone(0, "off", 0)
    tree.write("sys/class/thermal/thermal_zone0/mode", "disabled")
    tree.thermal_zone(1, "tsens_tz_sensor1", 41000, trips=(("passive", 2147483647), ("hot", -273000), ("hot", 95000)))
    (only,) = sample(tree).temperatures
    assert only.source == "thermal_zone1"
    assert only.trips == (Trip(type="hot", temp_c=95.0),)


def test_hwmon_inputs_with_labels_and_max_crit_trips(tree: FakeTree) -> None:
    tree.hwmon(
        0,
        "coretemp",
        {
            1: {"input": 53000, "label": "Package id 0", "max": 84000, "crit": 100000},
            2: {"input": 51000, "label": "Core 0", "max": 84000, "crit": 100000},
            10: {"input": 50000},
        },
    )
    tree.hwmon(1, "nvme", {1: {"input": 38850, "crit": 84850}})
    temps = by_source(sample(tree))
    assert list(temps) == ["hwmon0/temp1", "hwmon0/temp2", "hwmon0/temp10", "hwmon1/temp1"]
    assert temps["hwmon0/temp1"] == Temperature(
        source="hwmon0/temp1",
        kind="hwmon",
        label="coretemp/Package id 0",
        temp_c=53.0,
        trips=(Trip(type="max", temp_c=84.0), Trip(type="crit", temp_c=100.0)),
    )
    assert temps["hwmon0/temp10"].label == "coretemp"
    assert temps["hwmon1/temp1"].trips == (Trip(type="crit", temp_c=84.85),)


def test_old_kernels_hwmon_attributes_under_device(tree: FakeTree) -> None:
    tree.write("sys/class/hwmon/hwmon0/device/name", "k10temp")
    tree.write("sys/class/hwmon/hwmon0/device/temp1_input", 61250)
    (temp,) = sample(tree).temperatures
    assert (temp.source, temp.label, temp.temp_c) == ("hwmon0/temp1", "k10temp", 61.25)


def test_zones_and_hwmon_together_zones_first(tree: FakeTree) -> None:
    tree.laptop()
    assert [t.source for t in sample(tree).temperatures] == ["thermal_zone0", "thermal_zone1", "hwmon0/temp1"]


def test_empty_tree_has_no_temperatures_and_no_problems(tree: FakeTree) -> None:
    tree.root.mkdir(parents=True)
    snapshot = sample(tree)
    assert snapshot.temperatures == ()
    assert snapshot.battery is None
    assert snapshot.problems == ()
