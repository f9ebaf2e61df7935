"""Profiles relative to the device (issue 27): the shipped profiles state temperatures as distances to the device's own
trips, `governor policy show --root` prints what they resolve to, and an absolute value stays possible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from governor.cli import main
from policies.loader import load_policy
from policies.readings import ZoneFilter
from tests.policies.builders import snap
from tests.sensors.tree import FakeTree

Capture = pytest.CaptureFixture[str]


def phone_tree(root: Path, skin_trip_mc: int | None) -> FakeTree:
    """A phone as Termux sees it: a CPU zone with its 95 °C trip, a skin zone with (or without) its own trip, 2 big and
    6 little cores."""
    tree = FakeTree(root)
    tree.thermal_zone(0, "cpu-0-0-usr", 52000, (("passive", 95000), ("critical", 115000)))
    trips = (("passive", skin_trip_mc),) if skin_trip_mc is not None else ()
    tree.thermal_zone(1, "skin-therm", 36000, trips)
    tree.cluster(0, range(6), max_khz=2_000_000, capacity=300)
    tree.cluster(6, range(6, 8), max_khz=2_200_000, capacity=1024)
    tree.write("sys/devices/system/cpu/online", "0-7")
    tree.meminfo()
    return tree


@pytest.mark.parametrize(("trip", "setpoint", "critical"), [(41.0, 39.0, 44.0), (45.0, 43.0, 48.0)])
def test_android_termux_keeps_its_distances_to_the_phones_own_skin_trip(
    trip: float, setpoint: float, critical: float
) -> None:
    """It pinned 43 °C: on a phone whose skin trips at 41 °C its setpoint sat 2 °C *over* the trip, and the vendor's
    throttling held 17-47 % of the run. Now every threshold keeps its distance to the trip the zone declares."""
    policy = load_policy("android-termux")
    view = ZoneFilter(policy.thermal).view(snap(36.0, label="skin-therm", trips=[("passive", trip)]))
    assert (view.trip_c, view.setpoint_c, view.critical_c) == (trip, setpoint, critical)
    assert view.hot_enter_c == trip - 3.0
    assert view.trip_source == "skin-therm passive trip"


def test_without_a_trip_of_its_own_the_fallback_stands_in_and_an_absolute_trip_still_overrides() -> None:
    policy = load_policy("android-termux")
    view = ZoneFilter(policy.thermal).view(snap(36.0, label="skin-therm"))
    assert (view.trip_c, view.trip_source, view.setpoint_c, view.critical_c) == (43.0, "fallback", 41.0, 46.0)
    pinned = policy.thermal.model_copy(update={"trip_c": 43.0, "critical_c": 46.0})
    view = ZoneFilter(pinned).view(snap(36.0, label="skin-therm", trips=[("passive", 41.0)]))
    assert (view.trip_c, view.trip_source, view.critical_c) == (43.0, "policy", 46.0)


def test_the_pi_profile_judges_a_board_by_its_own_passive_trip() -> None:
    """A Raspberry Pi's cpu-thermal declares no passive trip: its firmware's 80 °C stands in. A kiosk board that
    declares 85 °C (RK3588) was held 5 °C under its real limit (0.937 x the best constant setting); now it is not."""
    policy = load_policy("raspberry-pi")
    pi = ZoneFilter(policy.thermal).view(snap(60.0, trips=[("critical", 110.0)]))
    assert (pi.trip_c, pi.setpoint_c, pi.critical_c) == (80.0, 78.5, 83.0)
    kiosk = ZoneFilter(policy.thermal).view(snap(60.0, trips=[("passive", 85.0), ("critical", 115.0)]))
    assert (kiosk.trip_c, kiosk.setpoint_c, kiosk.critical_c) == (85.0, 83.5, 88.0)


def test_policy_show_root_prints_the_numbers_for_this_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    phone_tree(root, 41000)
    assert main(["policy", "show", "android-termux", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "fallback_trip_c = 43.0" in out  # the profile as written, then what it means here
    assert (
        "#   skin-therm 36.0 °C: trip 41 °C (skin-therm passive trip), hot from 38 °C until under 36 °C, "
        "setpoint 39 °C, critical 44 °C"
    ) in out
    assert "#   threads on 8 CPUs (2 at 1.00, 6 at 0.29): idle 8, sustained 8, hot 8, low_battery 2, critical 1" in out
    assert main(["policy", "show", "default", "--root", str(root), "--json"]) == 0
    resolved = json.loads(capsys.readouterr().out)["resolved"]
    zones = {z["zone"]: z for z in resolved["zones"]}
    assert zones["cpu-0-0-usr"]["trip_c"] == 95.0  # each zone against its own trip
    assert zones["skin-therm"]["setpoint_c"] == 39.0
    # Both ask for the fastest count on this phone's cores: 8 threads at the little cores' pace (8 x 0.29 = 2.3 big
    # cores) beat the 2 big ones; 2 on low battery (its own limit), and 4 x 0.29 = 1.2 would lose to them.
    assert resolved["threads"]["sustained"] == 8


def test_policy_show_root_without_a_skin_trip_says_the_fallback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    phone_tree(root, None)
    assert main(["policy", "show", "android-termux", "--root", str(root)]) == 0
    assert "trip 43 °C (fallback)" in capsys.readouterr().out
