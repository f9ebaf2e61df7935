"""Temperatures from `sys/class/thermal/thermal_zone*` and `sys/class/hwmon/hwmon*`.

Discovery (the file list, zone types, trip points, hwmon names and labels) runs once and again when a listed file
vanishes or the sampler's rediscovery period passes; a sample then reads one file per temperature.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sensors.root import MAX_SANE_C, MIN_SANE_C, Reader, Root
from sensors.snapshot import TempKind, Trip

THERMAL_DIR = "sys/class/thermal"
HWMON_DIR = "sys/class/hwmon"

_TRIP_RE = re.compile(r"trip_point_(\d+)_temp$")
_HWMON_TEMP_RE = re.compile(r"temp(\d+)_input$")
_NUM_RE = re.compile(r"(\d+)$")


def natural(name: str) -> tuple[str, int]:
    match = _NUM_RE.search(name)
    return (name[: match.start()], int(match.group(1))) if match else (name, -1)


@dataclass(frozen=True, slots=True)
class Input:
    """One temperature file and what discovery learned about it."""

    source: str  # "thermal_zone0", "hwmon2/temp1"
    kind: TempKind  # "thermal_zone" or "hwmon"
    label: str
    path: str
    trips: tuple[Trip, ...]


def zone_celsius(text: str, value: float) -> float:
    """The kernel ABI says m°C; BSP and vendor kernels write °C, tenths or decimals. Normalise on magnitude.

    A decimal point means °C as written ("33.25"); |v| >= 1000 is m°C; 150 < |v| < 1000 is tenths (15.1-99.9 °C);
    anything smaller is °C. Ambiguous corners (a real 0.5 °C written as 500 m°C) are rare on devices that run LLMs.
    """
    if "." in text:
        return value
    magnitude = abs(value)
    if magnitude >= 1000:
        return value / 1000
    if magnitude > MAX_SANE_C:
        return value / 10
    return value


def read_zone(reader: Reader, item: Input) -> float | None:
    text = reader.text(item.path)
    if text is None:
        return None
    value = reader.parse(item.path, text)
    if value is None:
        return None
    if item.kind == "thermal_zone":
        return reader.sane_c(item.path, zone_celsius(text, value))
    return reader.sane_c(item.path, value / 1000)  # hwmon tempN_input is m°C by ABI, without vendor variants


def _trip(reader: Reader, path: str, trip_type: str, *, vendor_units: bool) -> Trip | None:
    text = reader.optional_text(path)
    if text is None:
        return None
    value = reader.parse(path, text)
    if value is None:
        return None
    temp_c = zone_celsius(text, value) if vendor_units else value / 1000
    # Disabled trips are written as INT_MAX, 255000 or -273000 by many drivers: not a fault, just not a trip.
    if not MIN_SANE_C <= temp_c <= MAX_SANE_C:
        return None
    return Trip(type=trip_type, temp_c=temp_c)


def discover_zones(root: Root, reader: Reader) -> list[Input]:
    base = root.path(THERMAL_DIR)
    found: list[Input] = []
    for name in sorted((n for n in reader.listdir(base) if n.startswith("thermal_zone")), key=natural):
        zone = f"{base}/{name}"
        # A zone switched off by its driver answers its temp with EINVAL/ENODATA on every read: not worth a problem.
        if reader.optional_text(f"{zone}/mode") == "disabled":
            continue
        if not root.exists(f"{zone}/temp") or reader.is_denied(f"{zone}/temp"):
            continue
        label = reader.optional_text(f"{zone}/type") or name
        trips: list[Trip] = []
        for number in sorted(int(m.group(1)) for m in map(_TRIP_RE.match, reader.listdir(zone)) if m):
            trip_type = reader.optional_text(f"{zone}/trip_point_{number}_type") or "unknown"
            trip = _trip(reader, f"{zone}/trip_point_{number}_temp", trip_type, vendor_units=True)
            if trip is not None:
                trips.append(trip)
        found.append(Input(name, "thermal_zone", label, f"{zone}/temp", tuple(trips)))
    return found


def discover_hwmon(root: Root, reader: Reader) -> list[Input]:
    base = root.path(HWMON_DIR)
    found: list[Input] = []
    for chip in sorted((n for n in reader.listdir(base) if n.startswith("hwmon")), key=natural):
        chip_dir = f"{base}/{chip}"
        # Kernels before 3.15 kept the attributes in hwmonN/device/ (psutil handles the same quirk).
        entries = reader.listdir(chip_dir)
        if not any(_HWMON_TEMP_RE.match(e) for e in entries) and "device" in entries:
            chip_dir = f"{chip_dir}/device"
            entries = reader.listdir(chip_dir)
        name = reader.optional_text(f"{chip_dir}/name") or reader.optional_text(f"{base}/{chip}/name") or chip
        for number in sorted(int(m.group(1)) for m in map(_HWMON_TEMP_RE.match, entries) if m):
            prefix = f"{chip_dir}/temp{number}"
            if reader.is_denied(f"{prefix}_input"):
                continue
            label = reader.optional_text(f"{prefix}_label")
            trips = (
                _trip(reader, f"{prefix}_max", "max", vendor_units=False),
                _trip(reader, f"{prefix}_crit", "crit", vendor_units=False),
            )
            found.append(
                Input(
                    f"{chip}/temp{number}",
                    "hwmon",
                    f"{name}/{label}" if label else name,
                    f"{prefix}_input",
                    tuple(t for t in trips if t is not None),
                )
            )
    return found
