"""Policy files: shipped profiles load; every mistake is one line naming the file, the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from governor.cli import main
from policies import PolicyError, load_policy, shipped_profiles
from policies.decision import State
from policies.loader import locate

GOOD_STATES = """
[states.idle]
threads = 4
n_ctx = 2048

[states.sustained]
threads = 4
n_ctx = 2048

[states.hot]
threads = 3
min_threads = 1
n_ctx = 1024
max_tokens_per_s = 8.0

[states.low_battery]
threads = 2
n_ctx = 1024

[states.critical]
threads = 1
n_ctx = 512
"""


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return info.value


def test_every_shipped_profile_loads_with_all_states() -> None:
    assert shipped_profiles() == ["android-termux", "default", "fanless-laptop", "raspberry-pi"]
    for name in shipped_profiles():
        policy = load_policy(name)
        assert policy.name == name
        assert set(policy.states) == set(State)


def test_a_minimal_file_gets_defaults(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, GOOD_STATES))
    assert policy.thermal.hot_margin_c == 5.0
    assert policy.states[State.HOT].min_threads == 1
    assert policy.name == "p"


def test_typo_names_file_line_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "[thermal]\nhot_margin_c = 3.0\nhysteresis_cc = 2.0\n" + GOOD_STATES)
    err = error_of(path)
    assert str(err) == f"{path}:3: thermal.hysteresis_cc: unknown key (a typo?)"


def test_wrong_type_in_a_state_table(tmp_path: Path) -> None:
    text = GOOD_STATES.replace("threads = 2\n", 'threads = "two"\n')
    path = write(tmp_path, text)
    err = error_of(path)
    line = text.splitlines().index('threads = "two"') + 1
    assert err.line == line
    assert err.field == "states.low_battery.threads"
    assert "valid integer" in err.reason


def test_missing_state_points_at_states(tmp_path: Path) -> None:
    text = GOOD_STATES.split("[states.critical]", maxsplit=1)[0]
    err = error_of(write(tmp_path, text))
    assert err.field == "states"
    assert "missing a profile for critical" in err.reason
    assert err.line == 2  # the first [states.*] header


def test_invalid_state_name(tmp_path: Path) -> None:
    text = GOOD_STATES + "\n[states.warm]\nthreads = 2\nn_ctx = 512\n"
    err = error_of(write(tmp_path, text))
    assert err.field.startswith("states.warm")
    assert err.line == text.splitlines().index("[states.warm]") + 1


def test_cross_field_rule_names_its_table(tmp_path: Path) -> None:
    text = "[battery]\nlow_percent = 5\ncritical_percent = 10\n" + GOOD_STATES
    err = error_of(write(tmp_path, text))
    assert (err.line, err.field) == (1, "battery")
    assert "critical_percent must be below low_percent" in err.reason


def test_hot_needs_a_rate_bound(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, GOOD_STATES.replace("max_tokens_per_s = 8.0\n", "")))
    assert "hot.max_tokens_per_s is required" in err.reason


def test_toml_syntax_error_has_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[thermal]\nhot_margin_c = = 3\n")
    err = error_of(path)
    assert err.line == 2
    assert str(err).startswith(f"{path}:2: not valid TOML")


def test_unknown_name_lists_the_shipped_profiles() -> None:
    with pytest.raises(PolicyError, match=r"shipped: .*raspberry-pi"):
        load_policy("raspbery-pi")


def test_locate_dotted_keys_and_inline_tables() -> None:
    text = "thermal.trip_c = 80\n[states]\nhot = { threads = 2, n_ctx = 512 }\n[states.idle]\n  threads = 4 # x\n"
    assert locate(text, ("thermal", "trip_c")) == 1
    assert locate(text, ("states", "hot", "threads")) == 3
    assert locate(text, ("states", "idle", "threads")) == 5
    assert locate(text, ("states", "idle", "n_ctx")) == 4
    assert locate(text, ("memory",)) is None


def test_cli_check_bad_file_exits_nonzero_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "[timing]\ninterval_s = -1\n" + GOOD_STATES)
    assert main(["policy", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        f"governor: error: {path}:2: timing.interval_s: Input should be greater than or equal to 0.01"
    ]


def test_cli_check_good_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", "android-termux"]) == 0
    assert "android-termux.toml: ok" in capsys.readouterr().out


def test_cli_show_prints_the_profile_with_its_comments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "show", "raspberry-pi"]) == 0
    out = capsys.readouterr().out
    assert "firmware throttles" in out
    assert "trip_c = 80.0" in out


def test_cli_show_json_fills_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["policy", "show", "default", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["thermal"]["forecast_horizon_s"] == 10.0
    assert data["states"]["hot"]["min_threads"] == 1
