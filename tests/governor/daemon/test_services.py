from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from governor.cli import main
from governor.daemon import services

VENV_GOVERNOR = services.governor_executable()


def test_system_unit_has_real_paths_and_the_contract(tmp_path: Path) -> None:
    (unit,) = services.plan("system", dest=tmp_path, args=["--config", "/etc/governor/governor.toml"])
    services.write([unit])
    text = (tmp_path / "governor.service").read_text()
    assert f"ExecStart={VENV_GOVERNOR} --log-json run --config /etc/governor/governor.toml\n" in text
    for line in (
        "Type=notify",
        "WatchdogSec=30",
        "Restart=on-failure",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "RuntimeDirectory=governor",
        "StateDirectory=governor",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=read-only",
        "PrivateTmp=yes",
        "DynamicUser=yes",
        "ReadWritePaths=-/sys/devices/system/cpu/cpufreq -/sys/devices/system/cpu/intel_pstate"
        " -/sys/devices/virtual/powercap",  # the clock caps and RAPL limits
        "CapabilityBoundingSet=CAP_DAC_OVERRIDE",
    ):
        assert f"\n{line}\n" in text
    assert "@" not in text.replace("@GOVERNOR", "")  # every placeholder filled


def test_user_unit_goes_to_the_users_config(tmp_path: Path) -> None:
    (unit,) = services.plan("user", env={"HOME": str(tmp_path)})
    assert unit.path == tmp_path / ".config/systemd/user/governor.service"
    assert "WantedBy=default.target" in unit.text
    assert "DynamicUser" not in unit.text
    assert "cpufreq" not in unit.text  # a user cannot write the clock caps: threads and rate are the actuators


def test_termux_scripts(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path / "home"), "PREFIX": "/data/data/com.termux/files/usr"}
    files = services.plan("termux", dest=tmp_path / "service", env=env)
    services.write(files)
    run = tmp_path / "service/governor/run"
    log = tmp_path / "service/governor/log/run"
    boot = tmp_path / "home/.termux/boot/start-governor"
    assert [f.path for f in files] == [run, log, boot]
    for script in (run, log, boot):
        assert script.read_text().startswith("#!/data/data/com.termux/files/usr/bin/sh\n")
        assert stat.S_IMODE(script.stat().st_mode) == 0o755
    assert f"exec {VENV_GOVERNOR} --log-json run" in run.read_text()
    assert "exec svlogd -tt" in log.read_text()
    boot_lines = boot.read_text().splitlines()
    assert boot_lines[2] == "termux-wake-lock"  # first, before anything starts
    assert boot_lines[3].endswith('/etc/profile.d/start-services.sh"')


def test_kind_detection() -> None:
    assert services.detect_kind({"TERMUX_VERSION": "0.118"}, 10123) == "termux"
    assert services.detect_kind({}, 0) == "system"
    assert services.detect_kind({}, 1000) == "user"


def test_cli_dry_run_prints_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["install-service", "--system", "--dest", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"# {tmp_path / 'governor.service'}" in out
    assert "Type=notify" in out
    assert "systemctl daemon-reload && systemctl enable --now governor" in out
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_and_says_how_to_enable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["install-service", "--termux", "--dest", str(tmp_path), "--boot-dir", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'governor/run'}" in out
    assert "sv-enable governor" in out
    assert (tmp_path / "b/start-governor").exists()


def test_unwritable_destination_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["install-service", "--system", "--dest", str(blocker / "sub")]) == 2
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (make system-deps installs it)"
)
@pytest.mark.parametrize("kind", ["system", "user"])
def test_units_pass_systemd_analyze_verify(kind: services.Kind, tmp_path: Path) -> None:
    assert os.access(VENV_GOVERNOR.split()[0], os.X_OK)  # verify needs ExecStart's binary to exist
    (unit,) = services.plan(kind, dest=tmp_path)
    services.write([unit])
    cmd = ["systemd-analyze", "verify", "--man=no", *(["--user"] if kind == "user" else []), str(unit.path)]
    env = os.environ | {"XDG_RUNTIME_DIR": str(tmp_path)}  # a user manager needs one, even to verify
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert result.returncode == 0, result.stderr
    ours = [line for line in result.stderr.splitlines() if str(unit.path) in line or "governor.service" in line]
    assert ours == [], ours
