"""`governor calibrate`: fit the device's thermal model (R and C per stage, ambient) to a recorded trace.

Power per sample comes from the battery's reading while discharging (a measurement), else from the device's power
model (idle + busy cores x thread power x frequency factor, busy cores from the CPU utilisation or, failing that,
the engine's busy flag x threads). The model is run over the trace with power held between samples (the same exact
discretisation the simulator uses) and scipy's least_squares fits log R, log C, the ambient and the case's starting
temperature to the recorded die (and, when present, case/skin) temperatures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

import policies
from govbase.errors import GovernorError
from governor.lab.device import DeviceSpec, ThermalSpec
from governor.lab.thermal import discretise
from sensors.snapshot import TraceRecord

THERMAL_KEYS = ("r_die_case_k_per_w", "c_die_j_per_k", "r_case_ambient_k_per_w", "c_case_j_per_k")


class CalibrationError(GovernorError):
    pass


@dataclass(frozen=True)
class Samples:
    t: np.ndarray
    power_w: np.ndarray
    die_c: np.ndarray
    case_c: np.ndarray | None  # NaN where a sample lacks it; None when the trace never has it


@dataclass(frozen=True)
class Fit:
    thermal: ThermalSpec
    ambient_c: float
    rmse_c: float
    samples: int
    power_source: str


def read_trace(path: Path) -> list[TraceRecord]:
    """The replay format, parsed by the policy core's own reader (a bad line is one error naming its number)."""
    try:
        with path.open() as stream:
            records = list(policies.read_trace(stream, path))
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc.strerror}") from exc
    if len(records) < 10:
        raise CalibrationError(f"{path}: {len(records)} samples; calibration needs at least 10")
    return records


def _zone_temp(record: TraceRecord, label: str) -> float | None:
    return next((z.temp_c for z in record.temperatures if z.label == label and z.temp_c is not None), None)


def samples_of(
    records: list[TraceRecord],
    device: DeviceSpec,
    threads: int | None = None,
    die_zone: str | None = None,
    case_zone: str | None = None,
) -> tuple[Samples, str]:
    """Die (and case) temperatures and power per record; zones by label, default the device file's die/case zones."""
    die_label = die_zone or next((z.label for z in device.zone if z.node == "die"), None)
    case_label = case_zone or next((z.label for z in device.zone if z.node == "case"), None)
    p, cpu = device.power, device.cpu
    threads = threads or cpu.cores
    t, power, die, case, sources = [], [], [], [], set()
    for r in records:
        die_c = _zone_temp(r, die_label) if die_label else None
        if die_c is None:
            continue
        bat = r.battery
        if bat is not None and bat.power_w is not None and bat.plugged is False:
            watts, source = bat.power_w, "battery"
        else:
            freq = r.cpu.freq_ratio if r.cpu.freq_ratio is not None else 1.0
            if r.cpu.util_percent is not None:
                cores = cpu.cores * r.cpu.util_percent / 100
            else:
                cores = threads if r.engine is not None and r.engine.busy else 0.0
            watts, source = p.idle_w + p.thread_w * cores * freq**p.freq_exponent, "power model"
        sources.add(source)
        t.append(r.t)
        power.append(watts)
        die.append(die_c)
        case_c = _zone_temp(r, case_label) if case_label else None
        case.append(np.nan if case_c is None else case_c)
    if len(t) < 10:
        labels = sorted({z.label for r in records for z in r.temperatures})
        raise CalibrationError(
            f"the trace has {len(t)} samples of zone {die_label!r} (calibration needs 10; its zones: "
            f"{', '.join(labels) or 'none'}); name the die zone with --zone"
        )
    case_arr = np.array(case)
    return (
        Samples(np.array(t), np.array(power), np.array(die), None if np.isnan(case_arr).all() else case_arr),
        " and ".join(sorted(sources)),
    )


def simulate_samples(spec: ThermalSpec, ambient_c: float, case0_c: float, s: Samples) -> tuple[np.ndarray, np.ndarray]:
    """Die and case temperatures at the sample times, starting from the first die reading and `case0_c`."""
    x1, x2 = s.die_c[0] - ambient_c, case0_c - ambient_c
    die, case = np.empty(len(s.t)), np.empty(len(s.t))
    cache: dict[float, tuple[float, float, float, float, float, float]] = {}
    die[0], case[0] = x1, x2
    for k in range(1, len(s.t)):
        h = round(float(s.t[k] - s.t[k - 1]), 3)
        c = cache.get(h)
        if c is None:
            c = cache[h] = discretise(spec, h) if h > 0 else (1.0, 0.0, 0.0, 1.0, 0.0, 0.0)
        pw = s.power_w[k - 1]
        x1, x2 = c[0] * x1 + c[1] * x2 + c[4] * pw, c[2] * x1 + c[3] * x2 + c[5] * pw
        die[k], case[k] = x1, x2
    return die + ambient_c, case + ambient_c


def fit(samples: Samples, start: DeviceSpec) -> tuple[ThermalSpec, float, float]:
    """(thermal spec, ambient °C, RMSE °C) by least squares, starting from `start`'s values."""
    th = start.thermal
    x0 = np.array([*np.log([getattr(th, k) for k in THERMAL_KEYS]), start.ambient_c, samples.die_c[0]])

    def unpack(x: np.ndarray) -> tuple[ThermalSpec, float, float]:
        values = np.exp(x[:4])
        return ThermalSpec(**dict(zip(THERMAL_KEYS, values.tolist(), strict=True))), float(x[4]), float(x[5])

    def residuals(x: np.ndarray) -> np.ndarray:
        spec, ambient, case0 = unpack(x)
        die, case = simulate_samples(spec, ambient, case0, samples)
        res: np.ndarray = die - samples.die_c
        if samples.case_c is not None:
            mask = ~np.isnan(samples.case_c)
            res = np.concatenate([res, case[mask] - samples.case_c[mask]])
        return res

    lower = np.array([*np.log([1e-3, 1e-3, 1e-3, 1e-2]), -40.0, -40.0])
    upper = np.array([*np.log([1e3, 1e5, 1e3, 1e6]), 80.0, 200.0])
    result = least_squares(residuals, np.clip(x0, lower + 1e-9, upper - 1e-9), bounds=(lower, upper), x_scale="jac")
    spec, ambient, _ = unpack(result.x)
    die, _case = simulate_samples(spec, ambient, float(result.x[5]), samples)
    rmse = float(np.sqrt(np.mean((die - samples.die_c) ** 2)))
    return spec, ambient, rmse


def calibrate(
    records: list[TraceRecord],
    start: DeviceSpec,
    threads: int | None = None,
    die_zone: str | None = None,
    case_zone: str | None = None,
) -> Fit:
    samples, source = samples_of(records, start, threads, die_zone, case_zone)
    spec, ambient, rmse = fit(samples, start)
    return Fit(thermal=spec, ambient_c=ambient, rmse_c=rmse, samples=len(samples.t), power_source=source)


def device_text(base_text: str, result: Fit, trace: Path) -> str:
    """The base device file with the fitted numbers in place (comments and everything else kept)."""
    values = {k: getattr(result.thermal, k) for k in THERMAL_KEYS} | {"ambient_c": result.ambient_c}
    text = base_text
    for key, value in values.items():
        text, n = re.subn(rf"^(\s*{key}\s*=\s*)[-+0-9.eE]+", rf"\g<1>{value:.4g}", text, count=1, flags=re.MULTILINE)
        if n != 1:
            raise CalibrationError(f"the base device file has no {key} line to replace")
    header = (
        f"# Thermal parameters and ambient fitted by `governor calibrate` to {trace.name} "
        f"({result.samples} samples, power from the {result.power_source}): RMSE {result.rmse_c:.2f} °C.\n"
    )
    return header + text
