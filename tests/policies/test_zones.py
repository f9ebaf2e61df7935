"""Each trusted zone against its own trip points (`default` on a phone: a 43 °C skin trip, a 95 °C CPU trip), as
`governor replay` shows it on hand-written traces."""

from __future__ import annotations

from pathlib import Path

import policies
from policies import StateMachine, load_policy
from policies.decision import Decision
from sensors.snapshot import Snapshot, Temperature, Trip
from tests.policies.builders import BUSY, snap, write_trace

SKIN_TRIP, CPU_TRIP, CPU_CRITICAL = 43.0, 95.0, 115.0


def phone(cpu_c: float, skin_c: float) -> Snapshot:
    skin = Temperature(
        source="thermal_zone7",
        kind="thermal_zone",
        label="skin-therm",
        temp_c=skin_c,
        trips=(Trip(type="passive", temp_c=SKIN_TRIP),),
    )
    return snap(cpu_c, label="cpu-0-0-usr", trips=[("passive", CPU_TRIP), ("critical", CPU_CRITICAL)], extra=[skin])


def replay(tmp_path: Path, snapshots: list[Snapshot]) -> list[Decision]:
    """The trace written as `governor record` would, read back and replayed through `default`, as `governor replay`."""
    trace = write_trace(tmp_path / "trace.jsonl", [(float(i), s, BUSY) for i, s in enumerate(snapshots)])
    with trace.open() as stream:
        return list(policies.replay(policies.read_trace(stream), StateMachine(load_policy("default"))))


def test_the_skin_approaching_its_trip_is_mitigated_before_it_while_the_cpu_is_far_from_its_own(tmp_path: Path) -> None:
    skins = [34.0 + 0.02 * i for i in range(600)]  # 34 -> 46 °C over ten minutes; the CPU zone sits at 70-75 °C
    lines = replay(tmp_path, [phone(70.0 + 5.0 * (i % 2), x) for i, x in enumerate(skins)])
    order = [line.state.value for line in lines]
    assert "critical" not in order  # 75 °C is far from the CPU's own 110 °C, whatever the skin's trip
    first_hot = order.index("hot")
    assert skins[first_hot] < SKIN_TRIP - 4.0  # the forecast of the skin acted, not the trip
    assert lines[first_hot].readings["zone"] == "skin-therm"
    assert "skin-therm" in lines[first_hot].reason
    assert f"under its {SKIN_TRIP:g} °C trip" in lines[first_hot].reason
    cut = next(i for i, line in enumerate(lines) if line.engine.threads < 4)
    assert skins[cut] < SKIN_TRIP  # threads taken before the skin reaches its trip
    pi = next(line for line in lines if line.rule == "thermal.pi")
    headroom = pi.readings["headroom_c"]
    assert isinstance(headroom, float)
    assert pi.reason.startswith(f"hot: skin-therm {SKIN_TRIP - headroom:.1f} °C, {headroom:.1f} °C under its 43 °C")
    assert lines[-1].engine.threads == 1  # past the setpoint the PI keeps cutting


def test_a_cpu_zone_past_its_own_critical_trip_is_critical_while_the_skin_is_cool(tmp_path: Path) -> None:
    lines = replay(tmp_path, [phone(80.0, 30.0)] * 5 + [phone(112.0, 30.0)] * 5)
    assert {line.state.value for line in lines[:5]}.isdisjoint({"hot", "critical"})  # 80 °C: 15 under its own trip
    crit = next(line for line in lines if line.state.value == "critical")
    assert crit.rule == "thermal.critical"
    assert "cpu-0-0-usr 112.0 °C ≥ critical 110 °C" in crit.reason  # its own 115 °C trip - critical_margin_c


def test_when_another_zone_starts_to_bind_the_forecast_sees_no_jump(tmp_path: Path) -> None:
    """The skin cools until the CPU zone (steady, 17 °C under its trip) has the least headroom: the reading the
    policy follows jumps from 26 to 78 °C, but the headroom it forecasts is continuous, so nothing heats up."""
    skins = [36.0] * 30 + [36.0 - 0.5 * i for i in range(30)] + [21.0] * 30  # 7 -> 22 °C under its trip
    lines = replay(tmp_path, [phone(78.0, x) for x in skins])
    zones = [line.readings["zone"] for line in lines]
    assert zones[0] == "skin-therm"
    assert zones[-1] == "cpu-0-0-usr"
    assert "hot" not in {line.state.value for line in lines}
