from __future__ import annotations

from pathlib import Path

import pytest

from governor.daemon.config import ConfigError, default_dirs, load_config


def test_root_defaults_are_systemd_paths() -> None:
    cfg = load_config(None, env={}, euid=0)
    assert cfg.control_socket == Path("/run/governor/control.sock")
    assert cfg.engine_socket == Path("/run/governor/engine.sock")
    assert cfg.state_dir == Path("/var/lib/governor")
    assert cfg.policy == "default"
    assert cfg.models is None  # the demo ladder


def test_user_defaults_use_xdg(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": "/run/user/1000", "HOME": str(tmp_path)}
    runtime, state = default_dirs(env, euid=1000)
    assert runtime == Path("/run/user/1000/governor")
    assert state == tmp_path / ".local/state/governor"


def test_user_without_runtime_dir_falls_back_to_tmp() -> None:
    runtime, _ = default_dirs({"HOME": "/h", "TMPDIR": "/data/tmp"}, euid=10123)
    assert runtime == Path("/data/tmp/governor-10123")


def test_systemd_directories_win() -> None:
    env = {"RUNTIME_DIRECTORY": "/run/governor:/run/other", "STATE_DIRECTORY": "/var/lib/private/governor"}
    assert default_dirs(env, euid=61000) == (Path("/run/governor"), Path("/var/lib/private/governor"))


def test_the_service_reads_its_configuration_directory(tmp_path: Path) -> None:
    (tmp_path / "governor.toml").write_text('policy = "raspberry-pi"\n')
    env = {"CONFIGURATION_DIRECTORY": str(tmp_path), "RUNTIME_DIRECTORY": "/run/governor", "HOME": "/"}
    cfg = load_config(None, env=env, euid=61234)  # DynamicUser: not root, no home
    assert cfg.policy == "raspberry-pi"
    assert cfg.control_socket == Path("/run/governor/control.sock")


def test_file_then_command_line(tmp_path: Path) -> None:
    f = tmp_path / "governor.toml"
    f.write_text('policy = "raspberry-pi"\ngroup = "governor"\n[restart]\nmax_failures = 3\ninitial_s = 0.5\n')
    cfg = load_config(f, {"policy": "fanless-laptop", "root": None}, env={}, euid=0)
    assert cfg.policy == "fanless-laptop"
    assert cfg.group == "governor"
    assert cfg.restart.max_failures == 3
    assert cfg.restart.delay_s(3) == 2.0


def test_a_typo_names_file_line_and_field(tmp_path: Path) -> None:
    f = tmp_path / "governor.toml"
    f.write_text('policy = "default"\n\ncontrol_sockt = "/tmp/x"\n')
    with pytest.raises(ConfigError, match=r"governor.toml:3: control_sockt: Extra inputs are not permitted"):
        load_config(f, env={}, euid=0)


def test_a_bad_value_names_the_field(tmp_path: Path) -> None:
    f = tmp_path / "governor.toml"
    f.write_text("[restart]\nmax_failures = 0\n")
    with pytest.raises(ConfigError, match=r"governor.toml:2: restart.max_failures: Input should be greater"):
        load_config(f, env={}, euid=0)


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml", env={}, euid=0)


def test_bad_toml_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "governor.toml"
    f.write_text("policy = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f, env={}, euid=0)
