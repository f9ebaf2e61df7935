"""Device and workload files: the shipped ones load, and a mistake is one line naming the file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from governor.lab.catalog import load_device
from governor.lab.files import LabFileError, shipped
from governor.lab.workload import load_workload

PI = Path(__file__).parents[2] / "governor" / "lab" / "devices" / "raspberry-pi-5.toml"


def test_shipped_devices_and_workloads_load() -> None:
    assert {"raspberry-pi-5", "phone", "fanless-laptop"} <= set(shipped("devices"))
    assert {"long-chat", "burst", "idle-day"} <= set(shipped("workloads"))
    for name in shipped("devices"):
        device = load_device(name)
        assert device.name == name
    assert load_workload("long-chat").duration_s == 1800


def test_the_limiting_zone_is_the_skin_on_a_phone_and_the_die_on_a_pi() -> None:
    assert load_device("phone").zone[load_device("phone").limit_zone()[0]].label == "skin-therm"
    index, trip = load_device("raspberry-pi-5").limit_zone()
    assert (load_device("raspberry-pi-5").zone[index].label, trip.temp_c) == ("cpu-thermal", 80.0)


def test_unknown_key_names_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "pi.toml"
    bad.write_text(PI.read_text().replace("c_die_j_per_k = 2.0", "c_die_j_per_k = 2.0\nc_dye = 3"))
    with pytest.raises(LabFileError) as info:
        load_device(str(bad))
    message = str(info.value)
    assert "\n" not in message
    line = PI.read_text().splitlines().index("c_die_j_per_k = 2.0") + 2
    assert message.startswith(f"{bad}:{line}: thermal.c_dye:")


def test_bad_value_is_reported_with_its_field(tmp_path: Path) -> None:
    bad = tmp_path / "pi.toml"
    bad.write_text(PI.read_text().replace("r_case_ambient_k_per_w = 7.8", "r_case_ambient_k_per_w = -1"))
    with pytest.raises(LabFileError, match=r"thermal\.r_case_ambient_k_per_w: Input should be greater than 0"):
        load_device(str(bad))


def test_frequency_steps_must_fall(tmp_path: Path) -> None:
    bad = tmp_path / "pi.toml"
    bad.write_text(PI.read_text().replace("freq_steps = [1.0, 0.958", "freq_steps = [1.0, 1.2"))
    with pytest.raises(LabFileError, match=r"freq_steps must start at 1\.0 and not increase"):
        load_device(str(bad))


def test_unknown_name_lists_the_shipped_ones() -> None:
    shipped = "fanless-laptop, n100-fanless-8b, phone, pi4-closed-case, raspberry-pi-5"
    with pytest.raises(LabFileError, match=f"no such device; shipped: {shipped}"):
        load_device("toaster")


def test_workload_range_must_be_ordered(tmp_path: Path) -> None:
    bad = tmp_path / "w.toml"
    bad.write_text('name = "w"\n[[phase]]\nkind = "chat"\nduration_s = 60\nthink_s = [40, 10]\n')
    with pytest.raises(LabFileError, match=r"w\.toml:\d+: phase\.0: think_s must be"):
        load_workload(str(bad))
