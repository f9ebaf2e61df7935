"""Device physics: a two-stage lumped thermal model, discretised exactly, and the kernel's step_wise throttling.

    C_d dT_d/dt = P - (T_d - T_c)/R_dc                    (die: the SoC and its spreader)
    C_c dT_c/dt = (T_d - T_c)/R_dc - (T_c - T_a)/R_ca     (case: board, chassis or phone skin)

With x = T - T_a this is x' = A x + B P. For P held over a step h, x(t+h) = Φ x + Γ P with Φ = e^{Ah} and
Γ = A⁻¹(Φ - I)B (zero-order hold): exact, so the model is stable and accurate at any step length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.linalg import expm

from governor.lab.device import ThermalSpec


def system_matrices(spec: ThermalSpec) -> tuple[np.ndarray, np.ndarray]:
    r1, c1 = spec.r_die_case_k_per_w, spec.c_die_j_per_k
    r2, c2 = spec.r_case_ambient_k_per_w, spec.c_case_j_per_k
    a = np.array([[-1 / (r1 * c1), 1 / (r1 * c1)], [1 / (r1 * c2), -(1 / r1 + 1 / r2) / c2]])
    b = np.array([1 / c1, 0.0])
    return a, b


def discretise(spec: ThermalSpec, h: float) -> tuple[float, float, float, float, float, float]:
    """(Φ11, Φ12, Φ21, Φ22, Γ1, Γ2) for a step of h seconds, as plain floats for a fast scalar update."""
    a, b = system_matrices(spec)
    phi = expm(a * h)
    gamma = np.linalg.solve(a, (phi - np.eye(2)) @ b)
    return (phi[0, 0], phi[0, 1], phi[1, 0], phi[1, 1], gamma[0], gamma[1])


class ThermalModel:
    """Die and case temperatures, with the energy bookkeeping the tests check (stored + out = in)."""

    def __init__(self, spec: ThermalSpec, ambient_c: float, start_power_w: float = 0.0) -> None:
        self.spec = spec
        self.ambient_c = ambient_c
        # start in equilibrium at `start_power_w` (a device that has been idling, not one just switched on)
        self.x_die = start_power_w * (spec.r_die_case_k_per_w + spec.r_case_ambient_k_per_w)
        self.x_case = start_power_w * spec.r_case_ambient_k_per_w
        self._cache: dict[float, tuple[float, float, float, float, float, float]] = {}
        self.energy_in_j = 0.0
        self.heat_out_j = 0.0
        self._x0 = (self.x_die, self.x_case)

    @property
    def die_c(self) -> float:
        return self.ambient_c + self.x_die

    @property
    def case_c(self) -> float:
        return self.ambient_c + self.x_case

    def step(self, power_w: float, h: float) -> None:
        coeffs = self._cache.get(h)
        if coeffs is None:
            coeffs = self._cache[h] = discretise(self.spec, h)
        p11, p12, p21, p22, g1, g2 = coeffs
        x1, x2 = self.x_die, self.x_case
        self.x_die = p11 * x1 + p12 * x2 + g1 * power_w
        self.x_case = p21 * x1 + p22 * x2 + g2 * power_w
        self.energy_in_j += power_w * h
        # trapezoid on the case node: independent of Φ and Γ, so a wrong discretisation breaks the energy balance
        self.heat_out_j += 0.5 * (x2 + self.x_case) / self.spec.r_case_ambient_k_per_w * h

    def set_ambient(self, ambient_c: float) -> None:
        """The room warms or cools; the device's absolute temperatures stay where they are."""
        self.x_die += self.ambient_c - ambient_c
        self.x_case += self.ambient_c - ambient_c
        self.ambient_c = ambient_c

    def heat_stored_j(self) -> float:
        """Heat stored since the start, relative to the starting state."""
        s = self.spec
        return s.c_die_j_per_k * (self.x_die - self._x0[0]) + s.c_case_j_per_k * (self.x_case - self._x0[1])


@dataclass
class _Instance:
    """One trip bound to the CPU cooling device, as a thermal instance is in the kernel."""

    zone: int
    temp_c: float
    hysteresis_c: float
    max_state: int
    target: int = 0


class StepWise:
    """The kernel's step_wise governor on one cooling device (the CPU frequency).

    At each poll, per passive trip: above the trip and rising → one state deeper (up to the trip's max_state);
    below trip - hysteresis → one state shallower; otherwise hold. The cooling device takes the deepest target.
    """

    def __init__(self, trips: Sequence[tuple[int, float, float, int]], n_zones: int) -> None:
        self._instances = [_Instance(z, t, h, m) for z, t, h, m in trips]
        self._last: list[float | None] = [None] * n_zones
        self.state = 0

    def poll(self, temps_c: Sequence[float]) -> int:
        for inst in self._instances:
            temp = temps_c[inst.zone]
            last = self._last[inst.zone]
            rising = last is None or temp > last
            if temp >= inst.temp_c and rising:
                inst.target = min(inst.target + 1, inst.max_state)
            elif temp < inst.temp_c - inst.hysteresis_c:
                inst.target = max(inst.target - 1, 0)
        self._last = list(temps_c)
        self.state = max((i.target for i in self._instances), default=0)
        return self.state
