"""A small test policy with round numbers: hot from a forecast of 75 °C, out below 71 °C, setpoint 78 °C."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import Any

import pytest

from policies.schema import Policy

TEST_POLICY = """
name = "test"
[timing]
interval_s = 1.0
mitigating_interval_s = 0.25
min_dwell_s = 2.0
recover_dwell_s = 10.0
recover_step_s = 5.0
[activity]
window_s = 10.0
enter_fraction = 0.5
exit_fraction = 0.2
exit_debounce_s = 2.0
[thermal]
trip_c = 80.0
hot_margin_c = 5.0
hysteresis_c = 4.0
control_margin_c = 2.0
critical_c = 90.0
enter_debounce_s = 1.0
exit_debounce_s = 3.0
[battery]
low_percent = 20.0
hysteresis_percent = 5.0
critical_percent = 5.0
enter_debounce_s = 2.0
exit_debounce_s = 2.0
[critical]
enter_debounce_s = 0.5
exit_debounce_s = 3.0
[memory]
psi_enter = 10.0
psi_exit = 2.0
psi_step_s = 5.0
psi_exit_debounce_s = 10.0
floor_mb = 100.0
[changes]
enabled = false  # one rule at a time: the price of a change has its own tests (test_changecost.py)
[states.idle]
threads = 4
n_ctx = 4096
[states.sustained]
threads = 4
n_ctx = 4096
[states.hot]
threads = 3
min_threads = 1
n_ctx = 2048
kv_type = "q8_0"
max_tokens_per_s = 10.0
min_tokens_per_s = 2.0
[states.low_battery]
threads = 2
n_ctx = 2048
kv_type = "q8_0"
max_tokens_per_s = 6.0
[states.critical]
threads = 1
n_ctx = 512
kv_type = "q4_0"
model = "smallest"
max_tokens_per_s = 1.0
"""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def make_policy(**tables: Any) -> Policy:
    """The test policy with some tables overridden, e.g. make_policy(thermal={"trip_c": None})."""
    data = _merge(tomllib.loads(TEST_POLICY), tables)
    data["thermal"] = {k: v for k, v in data["thermal"].items() if v is not None}
    return Policy.model_validate(data)


@pytest.fixture
def policy_factory() -> Callable[..., Policy]:
    return make_policy


@pytest.fixture
def policy() -> Policy:
    return make_policy()
