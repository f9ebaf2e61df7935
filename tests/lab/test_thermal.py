"""The thermal model against closed-form solutions, its energy balance, and the kernel's step_wise throttling."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.lab.device import ThermalSpec
from governor.lab.thermal import StepWise, ThermalModel

SPEC = ThermalSpec(r_die_case_k_per_w=1.5, c_die_j_per_k=2.0, r_case_ambient_k_per_w=7.8, c_case_j_per_k=45.0)


def closed_form(spec: ThermalSpec, power_w: float, t: float) -> tuple[float, float]:
    """Step response from ambient, by hand: eigenvalues of the 2x2 system and the modal sum (no matrix exponential)."""
    r1, c1, r2, c2 = spec.r_die_case_k_per_w, spec.c_die_j_per_k, spec.r_case_ambient_k_per_w, spec.c_case_j_per_k
    a11, a12, a21, a22 = -1 / (r1 * c1), 1 / (r1 * c1), 1 / (r1 * c2), -(1 / r1 + 1 / r2) / c2
    tr, det = a11 + a22, a11 * a22 - a12 * a21
    disc = math.sqrt(tr * tr / 4 - det)
    l1, l2 = tr / 2 + disc, tr / 2 - disc
    ss1, ss2 = power_w * (r1 + r2), power_w * r2  # steady state rise of die and case
    # x(t) = ss + k1 v1 e^{l1 t} + k2 v2 e^{l2 t}, x(0) = 0, with eigenvectors v = (a12, l - a11)
    v1, v2 = (a12, l1 - a11), (a12, l2 - a11)
    det_v = v1[0] * v2[1] - v2[0] * v1[1]
    k1 = (-ss1 * v2[1] + ss2 * v2[0]) / det_v
    k2 = (-ss2 * v1[0] + ss1 * v1[1]) / det_v
    e1, e2 = math.exp(l1 * t), math.exp(l2 * t)
    return ss1 + k1 * v1[0] * e1 + k2 * v2[0] * e2, ss2 + k1 * v1[1] * e1 + k2 * v2[1] * e2


@pytest.mark.parametrize("step_s", [0.01, 0.25, 7.0, 120.0])
def test_step_response_matches_the_closed_form_at_any_step(step_s: float) -> None:
    model = ThermalModel(SPEC, ambient_c=25.0)
    power = 4.4
    for k in range(1, int(1800 / step_s) + 1):
        model.step(power, step_s)
        if k % max(1, int(60 / step_s)) == 0:
            die, case = closed_form(SPEC, power, k * step_s)
            assert model.die_c == pytest.approx(25.0 + die, abs=1e-6)
            assert model.case_c == pytest.approx(25.0 + case, abs=1e-6)


def test_long_run_settles_at_power_times_resistance() -> None:
    model = ThermalModel(SPEC, ambient_c=20.0)
    model.step(5.0, 20_000.0)  # one huge step is still exact: no blow-up, lands on the steady state
    assert model.die_c == pytest.approx(20.0 + 5.0 * (1.5 + 7.8))
    assert model.case_c == pytest.approx(20.0 + 5.0 * 7.8)


def test_starts_in_equilibrium_at_the_given_power() -> None:
    model = ThermalModel(SPEC, ambient_c=25.0, start_power_w=2.7)
    before = (model.die_c, model.case_c)
    model.step(2.7, 600.0)
    assert (model.die_c, model.case_c) == pytest.approx(before)
    assert model.die_c == pytest.approx(25.0 + 2.7 * 9.3)  # the Pi 5 file's "idles near 50 °C"


def test_heat_stored_plus_heat_out_equals_energy_in() -> None:
    model = ThermalModel(SPEC, ambient_c=25.0, start_power_w=2.7)
    for k in range(7200):
        model.step(2.7 + (4.4 if (k // 200) % 2 else 0.0), 0.25)  # 50 s bursts
    assert model.energy_in_j == pytest.approx(2.7 * 1800 + 4.4 * 900)
    assert model.heat_stored_j() + model.heat_out_j == pytest.approx(model.energy_in_j, rel=1e-3)
    assert model.heat_stored_j() > 0  # it warmed up: not a trivial balance


def test_ambient_change_keeps_the_device_temperature() -> None:
    model = ThermalModel(SPEC, ambient_c=25.0, start_power_w=2.7)
    die = model.die_c
    model.set_ambient(35.0)
    assert model.die_c == pytest.approx(die)
    model.step(2.7, 20_000.0)
    assert model.die_c == pytest.approx(35.0 + 2.7 * 9.3)


def test_step_wise_steps_down_while_rising_above_the_trip_and_back_below_trip_minus_hysteresis() -> None:
    kernel = StepWise([(0, 80.0, 3.0, 9)], n_zones=1)
    states = [kernel.poll([temp]) for temp in (79.0, 80.5, 81.0, 81.5, 81.5, 81.2, 79.0, 77.5, 76.9, 76.0, 75.0)]
    # 80.5 ↑ (first sample counts as rising), 81 ↑, 81.5 ↑; flat 81.5 and falling 81.2 hold; 79.0 and 77.5 are
    # inside the hysteresis band (hold); below 77 each poll steps back one.
    assert states == [0, 1, 2, 3, 3, 3, 3, 3, 2, 1, 0]


def test_step_wise_respects_each_trips_deepest_state_and_takes_the_deepest_target() -> None:
    kernel = StepWise([(0, 80.0, 3.0, 2), (0, 85.0, 3.0, 5)], n_zones=1)
    temps = [80.0 + i for i in range(8)]  # 80..87, rising
    states = [kernel.poll([temp]) for temp in temps]
    assert states[:5] == [1, 2, 2, 2, 2]  # the soft trip stops at its max_state 2
    assert states[5:] == [2, 2, 3]  # the hard trip (85) started at 85: 1, 2 (held by the max), then 3
    # a second zone's trip drives the same cooling device
    two = StepWise([(0, 80.0, 3.0, 5), (1, 43.0, 3.0, 5)], n_zones=2)
    assert [two.poll([60.0, temp]) for temp in (42.0, 43.5, 44.0)] == [0, 1, 2]


@given(
    powers=st.lists(st.floats(min_value=0.0, max_value=20.0), min_size=1, max_size=60),
    step_s=st.floats(min_value=0.001, max_value=600.0),
)
def test_any_power_sequence_at_any_step_stays_between_ambient_and_the_hottest_steady_state(
    powers: list[float], step_s: float
) -> None:
    model = ThermalModel(SPEC, ambient_c=25.0)
    ceiling = 25.0 + max(powers) * (1.5 + 7.8)
    for p in powers:
        model.step(p, step_s)
        assert 25.0 - 1e-9 <= model.case_c <= model.die_c + 1e-9  # heat flows die -> case -> air
        assert model.die_c <= ceiling + 1e-9
