"""Battery and external power from `sys/class/power_supply/*`.

Several batteries are combined the way UPower's display device does (energy-weighted percent, summed power);
no battery at all is normal (a Pi, a desktop) and gives `None`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sensors.root import Reader, Root
from sensors.snapshot import Battery
from sensors.thermal import natural

POWER_DIR = "sys/class/power_supply"

# Read every sample when discovery saw them; absent ones are simply not offered by this device.
_BATTERY_FILES = (
    "status",
    "capacity",
    "power_now",
    "current_now",
    "voltage_now",
    "energy_now",
    "energy_full",
    "charge_now",
    "charge_full",
    "voltage_min_design",
    "temp",
)
_CHARGING = {"Charging": True, "Discharging": False, "Full": False, "Not charging": False}
_PLUGGED = {"Charging": True, "Full": True, "Not charging": True, "Discharging": False}


@dataclass(frozen=True, slots=True)
class Supply:
    name: str
    dir: str
    battery: bool
    files: frozenset[str]


@dataclass(slots=True)
class _Cell:
    name: str
    status: str | None = None
    percent: float | None = None
    power_w: float | None = None
    energy_wh: float | None = None
    energy_full_wh: float | None = None
    temp_c: float | None = None


def _is_external(kind: str) -> bool:
    """A source of external power. Phones also list charger internals (BMS, Parallel, Main) with an `online` that
    says nothing about a cable, so only the kernel's own source types count: Mains, USB*, Wireless."""
    return kind in ("Mains", "Wireless", "Wipower") or kind.startswith("USB")


def discover_supplies(root: Root, reader: Reader) -> list[Supply]:
    base = root.path(POWER_DIR)
    found: list[Supply] = []
    for name in sorted(reader.listdir(base), key=natural):
        path = f"{base}/{name}"
        kind = reader.optional_text(f"{path}/type")
        # scope=Device marks a mouse's or headset's battery: it says nothing about the machine's power.
        if kind is None or reader.optional_text(f"{path}/scope") == "Device":
            continue
        if kind == "Battery":
            if reader.optional_text(f"{path}/present") == "0":
                continue  # an empty battery bay
            files = frozenset(
                f for f in _BATTERY_FILES if root.exists(f"{path}/{f}") and not reader.is_denied(f"{path}/{f}")
            )
            if files:  # nothing readable (SELinux): as good as no battery, so termux-battery-status can answer
                found.append(Supply(name, path, True, files))
        elif _is_external(kind) and root.exists(f"{path}/online"):
            found.append(Supply(name, path, False, frozenset({"online"})))
    return found


def _cell(reader: Reader, supply: Supply) -> _Cell:
    cell = _Cell(supply.name)
    files, path = supply.files, supply.dir

    def num(name: str) -> float | None:
        return reader.number(f"{path}/{name}") if name in files else None

    if "status" in files:
        cell.status = reader.text(f"{path}/status")
    capacity = num("capacity")
    if capacity is not None:
        if 0 <= capacity <= 100:
            cell.percent = capacity
        else:
            reader.problem(f"{path}/capacity", f"absurd: {capacity:g} % is outside 0..100 %")
    power_uw = num("power_now")
    if power_uw is None and "current_now" in files and "voltage_now" in files:
        current_ua, voltage_uv = num("current_now"), num("voltage_now")
        if current_ua is not None and voltage_uv is not None:
            power_uw = current_ua * voltage_uv / 1e6
    if power_uw is not None and math.isfinite(power_uw):
        cell.power_w = abs(power_uw) / 1e6  # the sign convention differs between drivers
    if "energy_now" in files:
        now, full = num("energy_now"), num("energy_full")
        cell.energy_wh = None if now is None else now / 1e6
        cell.energy_full_wh = None if full is None else full / 1e6
    elif "charge_now" in files:
        volts_uv = num("voltage_min_design") or num("voltage_now")
        now, full = num("charge_now"), num("charge_full")
        if volts_uv:
            cell.energy_wh = None if now is None else now * volts_uv / 1e12
            cell.energy_full_wh = None if full is None else full * volts_uv / 1e12
    if cell.percent is None and cell.energy_wh is not None and cell.energy_full_wh:
        cell.percent = min(100.0, 100 * cell.energy_wh / cell.energy_full_wh)
    tenths = num("temp")
    if tenths is not None:
        cell.temp_c = reader.sane_c(f"{path}/temp", tenths / 10)
    return cell


def _combine(cells: list[_Cell], plugged: bool | None) -> Battery:
    def known(values: list[float | None]) -> list[float]:
        return [v for v in values if v is not None]

    energies, fulls = known([c.energy_wh for c in cells]), known([c.energy_full_wh for c in cells])
    whole = len(energies) == len(fulls) == len(cells)
    percents = known([c.percent for c in cells])
    if whole and sum(fulls) > 0 and len(cells) > 1:
        percent: float | None = min(100.0, 100 * sum(energies) / sum(fulls))
    else:
        percent = sum(percents) / len(percents) if percents else None
    charging_states = [_CHARGING.get(c.status or "") for c in cells]
    charging = True if True in charging_states else (False if False in charging_states else None)
    if plugged is None:
        plugged_states = [_PLUGGED.get(c.status or "") for c in cells]
        plugged = True if True in plugged_states else (False if False in plugged_states else None)
    powers, temps = known([c.power_w for c in cells]), known([c.temp_c for c in cells])
    return Battery(
        percent=percent,
        charging=charging,
        plugged=plugged,
        power_w=sum(powers) if powers else None,
        temp_c=max(temps) if temps else None,
        source="sysfs:" + "+".join(c.name for c in cells),
        energy_wh=sum(energies) if whole else None,
        energy_full_wh=sum(fulls) if whole else None,
    )


def read_battery(reader: Reader, supplies: list[Supply]) -> Battery | None:
    cells = [_cell(reader, s) for s in supplies if s.battery]
    if not cells:
        return None
    online = [reader.number(f"{s.dir}/online") for s in supplies if not s.battery]
    plugged = True if any(online) else (False if online and None not in online else None)
    return _combine(cells, plugged)
