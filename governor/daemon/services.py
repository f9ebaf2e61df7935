"""`governor install-service`: the systemd units and Termux scripts, written with this installation's real paths."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import governor
from govbase.errors import GovernorError

Kind = Literal["system", "user", "termux"]
TERMUX_PREFIX = "/data/data/com.termux/files/usr"


class InstallError(GovernorError):
    pass


@dataclass(frozen=True)
class ServiceFile:
    path: Path
    text: str
    executable: bool


def templates_dir() -> Path:
    """In a wheel the templates ship as governor/_systemd; in a checkout they are the repo's systemd/."""
    packaged = Path(governor.__file__).parent / "_systemd"
    return packaged if packaged.is_dir() else Path(governor.__file__).parent.parent / "systemd"


def governor_executable() -> str:
    """The `governor` script next to this interpreter (the venv's), else `python -m governor` with this python."""
    beside = Path(sys.executable).parent / "governor"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("governor")
    return found if found else f"{sys.executable} -m governor"


def detect_kind(env: Mapping[str, str], euid: int) -> Kind:
    if env.get("TERMUX_VERSION") or "com.termux" in env.get("PREFIX", ""):
        return "termux"
    return "system" if euid == 0 else "user"


def _fill(template: str, values: Mapping[str, str]) -> str:
    for key, value in values.items():
        template = template.replace(f"@{key}@", value)
    return template


def plan(
    kind: Kind,
    *,
    dest: Path | None = None,
    boot_dir: Path | None = None,
    args: list[str] | None = None,
    executable: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[ServiceFile]:
    env = os.environ if env is None else env
    home = Path(env.get("HOME", "~")).expanduser()
    values = {
        "GOVERNOR": executable or governor_executable(),
        "ARGS": shlex.join(args or []),
        "PREFIX": env.get("PREFIX", TERMUX_PREFIX) if kind == "termux" else "",
    }
    src = templates_dir()
    if not src.is_dir():
        raise InstallError(f"service templates not found in {src}")

    def made(template: str, path: Path, *, executable: bool = False) -> ServiceFile:
        return ServiceFile(path, _fill((src / template).read_text(), values), executable)

    if kind == "system":
        return [made("governor.service", (dest or Path("/etc/systemd/system")) / "governor.service")]
    if kind == "user":
        config_home = Path(env.get("XDG_CONFIG_HOME", str(home / ".config")))
        return [made("governor-user.service", (dest or config_home / "systemd" / "user") / "governor.service")]
    service = (dest or Path(values["PREFIX"]) / "var" / "service") / "governor"
    boot = boot_dir or home / ".termux" / "boot"
    return [
        made("termux/run", service / "run", executable=True),
        made("termux/log/run", service / "log" / "run", executable=True),
        made("termux/boot", boot / "start-governor", executable=True),
    ]


def how_to_enable(kind: Kind) -> str:
    if kind == "system":
        return "enable it with: systemctl daemon-reload && systemctl enable --now governor"
    if kind == "user":
        return "enable it with: systemctl --user daemon-reload && systemctl --user enable --now governor"
    return (
        "enable it with: pkg install termux-services && sv-enable governor (in a new Termux session); "
        "install the Termux:Boot app and open it once to start it at boot"
    )


def write(files: list[ServiceFile]) -> None:
    for f in files:
        try:
            f.path.parent.mkdir(parents=True, exist_ok=True)
            f.path.write_text(f.text)
            f.path.chmod(0o755 if f.executable else 0o644)
        except OSError as exc:
            raise InstallError(f"{f.path}: cannot write: {exc.strerror} (try --dest DIR or --user)") from exc
