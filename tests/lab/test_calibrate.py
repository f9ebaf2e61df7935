"""Calibration recovers a known device's thermal parameters from a trace the simulator recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from governor.cli import main
from governor.lab.calibrate import THERMAL_KEYS, calibrate, read_trace
from governor.lab.catalog import load_device
from governor.lab.deciders import Ungoverned
from governor.lab.experiment import simulate
from governor.lab.workload import load_workload


def record(device_name: str, path: Path) -> None:
    device = load_device(device_name)
    with path.open("w") as out:
        simulate(device, Ungoverned(device), load_workload("burst"), policy_name="none", minutes=15, trace=out)


@pytest.mark.parametrize("device_name", ["raspberry-pi-5", "phone"])  # power from the CPU model / the battery
def test_recovers_the_parameters_of_a_known_device(tmp_path: Path, device_name: str) -> None:
    truth = load_device(device_name)
    trace = tmp_path / "trace.jsonl"
    record(device_name, trace)
    wrong = truth.thermal.model_copy(update={k: getattr(truth.thermal, k) * 1.6 for k in THERMAL_KEYS})
    start = truth.model_copy(update={"thermal": wrong, "ambient_c": 18.0})
    fit = calibrate(read_trace(trace), start)
    assert fit.rmse_c < 0.5
    assert fit.ambient_c == pytest.approx(truth.ambient_c, abs=1.5)
    for key in ("r_die_case_k_per_w", "r_case_ambient_k_per_w", "c_case_j_per_k"):
        assert getattr(fit.thermal, key) == pytest.approx(getattr(truth.thermal, key), rel=0.1), key
    assert fit.thermal.c_die_j_per_k == pytest.approx(truth.thermal.c_die_j_per_k, rel=0.3)  # seconds-fast: loose


def test_cli_writes_a_device_file_that_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    record("raspberry-pi-5", trace)
    out = tmp_path / "my-pi.toml"
    assert main(["calibrate", str(trace), "--device", "raspberry-pi-5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "RMSE" in printed
    device = load_device(str(out))
    assert device.thermal.r_case_ambient_k_per_w == pytest.approx(7.8, rel=0.1)
    assert out.read_text().startswith("# Thermal parameters and ambient fitted by `governor calibrate`")


def test_a_bad_trace_line_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"t": 0}\n{"t": "soon"}\n')
    assert main(["calibrate", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"governor: error: {trace}:2: t:")
    assert "\n" not in err


def test_a_trace_without_the_die_zone_names_the_zones_it_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "phone.jsonl"
    record("phone", trace)
    assert main(["calibrate", str(trace), "--device", "raspberry-pi-5"]) == 2
    err = capsys.readouterr().err
    assert "0 samples of zone 'cpu-thermal'" in err
    assert "its zones: cpu-0-0-usr, skin-therm" in err
    assert main(["calibrate", str(trace), "--device", "raspberry-pi-5", "--zone", "cpu-0-0-usr"]) == 0
