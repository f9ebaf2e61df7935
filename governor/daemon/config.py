"""The daemon's config file (TOML, validated with extra="forbid") and its defaults for systemd, a user and Termux.

    policy = "default"                 # a shipped profile name or a policy TOML file
    root = "/"                         # where /sys and /proc are read (tests: a fake tree)
    models = "/var/lib/governor/models/ladder.toml"   # absent: the demo ladder, written on first run
    device_model = "/var/lib/governor/device.toml"    # optional: `governor bench-device` output, the model's prior
    control_socket = "/run/governor/control.sock"
    engine_socket = "/run/governor/engine.sock"   # the public chat socket (the engine child's is engine-child.sock)
    state_dir = "/var/lib/governor"
    group = "governor"                 # absent: sockets are 0600 (owner only); set: 0660 for this group
    metrics_textfile = "/var/lib/node_exporter/textfile/governor.prom"
    [restart]
    initial_s = 1.0
    max_s = 60.0
    max_failures = 5

Command-line flags override the file; the file overrides the defaults.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govbase.errors import GovernorError
from governor.daemon.supervisor import RestartPolicy
from policies.loader import (  # the policy files' reader and line finder: tomllib keeps no positions
    UnreadableText,
    locate,
    parse_toml,
    read_text,
    validation_message,
)


class ConfigError(GovernorError):
    pass


class DaemonConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    policy: str = "default"
    root: Path = Field(default=Path("/"), strict=False)  # TOML gives strings; a Path from the command line
    models: Path | None = Field(default=None, strict=False)
    # a `governor bench-device` TOML: the prior of the policy's device model
    device_model: Path | None = Field(default=None, strict=False)
    control_socket: Path = Field(strict=False)
    engine_socket: Path = Field(strict=False)
    state_dir: Path = Field(strict=False)
    group: str | None = None
    metrics_textfile: Path | None = Field(default=None, strict=False)
    udev: bool = True  # watch power_supply/thermal uevents (says so once and polls when udev is unavailable)
    drain_timeout_s: float = Field(default=10.0, ge=0, le=3600)  # at shutdown, how long a running answer may finish
    stop_timeout_s: float = Field(default=10.0, gt=0, le=3600)  # beyond the drain, before the engine is killed
    request_hold_s: float = Field(default=10.0, ge=0, le=600)  # a request waits this long for a (re)starting engine
    restart: RestartPolicy = RestartPolicy()

    @property
    def engine_child_socket(self) -> Path:
        """The engine child's private socket, beside the public one the daemon holds (engine.sock ->
        engine-child.sock)."""
        public = self.engine_socket
        return public.with_name(f"{public.stem}-child{public.suffix}")


def default_dirs(env: Mapping[str, str] | None = None, euid: int | None = None) -> tuple[Path, Path]:
    """(runtime dir, state dir): systemd's RuntimeDirectory/StateDirectory, root's /run and /var/lib, or the user's."""
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        runtime, state = Path("/run/governor"), Path("/var/lib/governor")
    else:
        xdg_runtime = env.get("XDG_RUNTIME_DIR")
        tmp = Path(env.get("TMPDIR", "/tmp"))
        runtime = Path(xdg_runtime) / "governor" if xdg_runtime else tmp / f"governor-{euid}"
        xdg_state = env.get("XDG_STATE_HOME")
        state = Path(xdg_state) if xdg_state else Path(env.get("HOME", str(tmp))) / ".local" / "state"
        state = state / "governor"
    # systemd's RuntimeDirectory= / StateDirectory= may list several, colon-separated; the first is ours.
    if env.get("RUNTIME_DIRECTORY"):
        runtime = Path(env["RUNTIME_DIRECTORY"].split(":")[0])
    if env.get("STATE_DIRECTORY"):
        state = Path(env["STATE_DIRECTORY"].split(":")[0])
    return runtime, state


def default_config_file(env: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    if env.get("CONFIGURATION_DIRECTORY"):  # systemd's ConfigurationDirectory= (a DynamicUser is not root)
        return Path(env["CONFIGURATION_DIRECTORY"].split(":")[0]) / "governor.toml"
    if euid == 0:
        return Path("/etc/governor/governor.toml")
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "/")) / ".config")
    return Path(base) / "governor" / "governor.toml"


def load_config(
    path: Path | None,
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    euid: int | None = None,
) -> DaemonConfig:
    """`path` None: the default file if it exists. `overrides` (non-None values) are the command line's."""
    explicit = path is not None
    path = path if path is not None else default_config_file(env, euid)
    data: dict[str, Any] = {}
    text = ""
    if explicit or path.exists():
        try:
            text = read_text(path)
            data = parse_toml(text)
        except UnreadableText as exc:
            raise ConfigError(f"{path}: {exc.reason}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    runtime, state = default_dirs(env, euid)
    defaults = {
        "control_socket": runtime / "control.sock",
        "engine_socket": runtime / "engine.sock",
        "state_dir": state,
    }
    merged = {**defaults, **data, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    try:
        return DaemonConfig.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        line = locate(text, err["loc"])
        where = f"{path}:{line}" if line else str(path)
        raise ConfigError(f"{where}: {field}: {validation_message(err['msg'])}") from exc
