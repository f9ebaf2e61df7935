"""power_supply: one or several batteries, mains, no battery; power from power_now or current x voltage."""

from __future__ import annotations

import pytest

from sensors.sampler import SensorSampler
from sensors.snapshot import Battery, Snapshot, Temperature
from tests.sensors.tree import FakeTree


def sample(tree: FakeTree) -> Snapshot:
    return SensorSampler(tree.root, cpu_util=None).sample()


def test_laptop_battery_on_battery_power(tree: FakeTree) -> None:
    tree.battery("BAT0", status="Discharging", capacity=87, power_now=5_200_000)
    tree.mains("AC", online=0)
    assert sample(tree).battery == Battery(
        percent=87.0,
        charging=False,
        plugged=False,
        power_w=5.2,
        temp_c=None,
        source="sysfs:BAT0",
        energy_wh=43.5,
        energy_full_wh=50.0,
    )


def test_mains_online_means_plugged_and_charging_follows_status(tree: FakeTree) -> None:
    tree.battery("BAT0", status="Charging")
    tree.mains("AC", online=1)
    battery = sample(tree).battery
    assert battery is not None
    assert (battery.plugged, battery.charging) == (True, True)


@pytest.mark.parametrize(
    ("status", "plugged", "charging"),
    [("Charging", True, True), ("Full", True, False), ("Not charging", True, False), ("Discharging", False, False)],
)
def test_without_external_supplies_the_status_says_whether_plugged(
    tree: FakeTree, status: str, plugged: bool, charging: bool
) -> None:
    tree.battery("battery", status=status)
    battery = sample(tree).battery
    assert battery is not None
    assert (battery.plugged, battery.charging) == (plugged, charging)


def test_phone_battery_power_from_current_times_voltage_and_temp_in_tenths(tree: FakeTree) -> None:
    path = tree.battery("battery", power_now=0, energy_now=0, energy_full=0, current_now=-450_000, temp=312)
    for name in ("power_now", "energy_now", "energy_full"):
        (tree.root / path / name).unlink()
    tree.write(f"{path}/voltage_now", 3_900_000)
    tree.supply("usb", type="USB", online=1)
    snapshot = sample(tree)
    battery = snapshot.battery
    assert battery is not None
    assert battery.power_w == pytest.approx(0.45 * 3.9)  # |µA| x µV, the sign differs between drivers
    assert battery.temp_c == pytest.approx(31.2)
    assert battery.plugged is True
    assert battery.energy_wh is None


def test_charge_in_microamp_hours_becomes_watt_hours(tree: FakeTree) -> None:
    path = tree.battery("BAT1", charge_now=2_000_000, charge_full=4_000_000, voltage_min_design=11_100_000)
    for name in ("energy_now", "energy_full", "capacity"):
        (tree.root / path / name).unlink()
    battery = sample(tree).battery
    assert battery is not None
    assert battery.energy_wh == pytest.approx(22.2)
    assert battery.energy_full_wh == pytest.approx(44.4)
    assert battery.percent == pytest.approx(50.0)  # computed from energy when capacity is absent


def test_two_batteries_combine_energy_weighted(tree: FakeTree) -> None:
    tree.battery("BAT0", capacity=100, energy_now=20_000_000, energy_full=20_000_000, power_now=1_000_000)
    tree.battery("BAT1", capacity=10, energy_now=6_000_000, energy_full=60_000_000, power_now=4_000_000, temp=350)
    battery = sample(tree).battery
    assert battery is not None
    assert battery.source == "sysfs:BAT0+BAT1"
    assert battery.percent == pytest.approx(100 * 26 / 80)
    assert battery.power_w == pytest.approx(5.0)
    assert battery.energy_wh == pytest.approx(26.0)
    assert battery.temp_c == pytest.approx(35.0)


def test_no_battery_is_normal(tree: FakeTree) -> None:
    tree.mains("ACAD", online=1)
    snapshot = sample(tree)
    assert snapshot.battery is None
    assert snapshot.problems == ()


def test_peripheral_batteries_and_empty_bays_are_not_the_machine(tree: FakeTree) -> None:
    tree.battery("hidpp_battery_0", scope="Device", capacity=20)
    tree.battery("BAT1", present=0, capacity=0)
    assert sample(tree).battery is None


def test_battery_temperature_is_the_thermal_signal_of_last_resort(tree: FakeTree) -> None:
    tree.battery("battery", temp=367)
    assert sample(tree).temperatures == (
        Temperature(source="sysfs:battery", kind="battery", label="battery", temp_c=36.7),
    )
    tree.thermal_zone(0, "cpu-thermal", 50000)
    assert [t.kind for t in sample(tree).temperatures] == ["thermal_zone"]


def test_last_resort_also_when_zones_exist_but_none_is_readable(tree: FakeTree) -> None:
    tree.thermal_zone(0, "cpu-thermal", "garbage")
    tree.battery("battery", temp=367)
    snapshot = sample(tree)
    assert [(t.kind, t.temp_c) for t in snapshot.temperatures] == [("thermal_zone", None), ("battery", 36.7)]
    assert [p.path for p in snapshot.problems] == ["/sys/class/thermal/thermal_zone0/temp"]


def test_phone_charger_internals_do_not_count_as_external_power(tree: FakeTree) -> None:
    tree.battery("battery", status="Discharging")
    tree.supply("bms", type="BMS", online=1)
    tree.supply("parallel", type="Parallel", online=1)
    tree.supply("usb", type="USB_HVDCP_3", online=0)
    battery = sample(tree).battery
    assert battery is not None
    assert battery.plugged is False


def test_a_fast_tick_reads_the_battery_at_most_every_slow_max_age_s(tree: FakeTree) -> None:
    tree.battery(capacity=80)
    now = [100.0]
    sampler = SensorSampler(tree.root, cpu_util=None, slow_max_age_s=1.0, monotonic=lambda: now[0])

    def percent() -> float | None:
        battery = sampler.sample().battery
        assert battery is not None
        return battery.percent

    assert percent() == 80.0
    tree.write("sys/class/power_supply/BAT0/capacity", 79)
    now[0] += 0.5
    assert percent() == 80.0  # half a second later: the last reading
    now[0] += 0.5
    assert percent() == 79.0  # a second after the read: read again
    tree.write("sys/class/power_supply/BAT0/capacity", 78)
    sampler.invalidate()  # a supply came or went: rediscovered
    assert percent() == 78.0  # at once
    tree.write("sys/class/power_supply/BAT0/capacity", 77)
    sampler.supply_changed()  # a power_supply "change" uevent
    assert percent() == 77.0  # at once


def test_a_battery_problem_stays_reported_while_the_reading_is_reused(tree: FakeTree) -> None:
    tree.battery(capacity="garbage")
    now = [100.0]
    sampler = SensorSampler(tree.root, cpu_util=None, slow_max_age_s=1.0, monotonic=lambda: now[0])
    first = sampler.sample().problems
    now[0] += 0.25
    assert [p for p in sampler.sample().problems if "capacity" in p.path] == [p for p in first if "capacity" in p.path]
    assert any("capacity" in p.path for p in first)
