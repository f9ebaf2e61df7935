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
    engine = "llama-server"            # or "llama-cpp-python" (built in, the default), "external" (docs/engines.md)
    llama_server = "/usr/bin/llama-server"  # optional: found on the PATH, then beside python
    [restart]
    initial_s = 1.0
    max_s = 60.0
    max_failures = 5
    [[upstream]]                       # any number; none: every request runs on the device (docs/routing.md)
    name = "lan"
    base_url = "http://localhost/v1"   # OpenAI-compatible
    socket = "/path/to/engine.sock"    # optional: reach base_url over this Unix socket
    api_key_file = "/etc/governor/lan.key"  # optional (or api_key_env = "LAN_KEY")

Command-line flags override the file; the file overrides the defaults.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from govbase.errors import GovernorError
from governor.daemon.restarts import RestartPolicy
from policies.loader import (  # the policy files' reader and line finder: tomllib keeps no positions
    UnreadableText,
    locate,
    parse_toml,
    read_text,
    validation_message,
)


class ConfigError(GovernorError):
    pass


_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}|[0-9A-Fa-f:.]{2,45}")  # a DNS name, IPv4, IPv6 (no brackets)
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
ModelName = Annotated[str, Field(min_length=1, max_length=200)]


class Upstream(BaseModel):
    """An OpenAI-compatible endpoint a request may be sent to when the device cannot meet the policy's [slo].
    The API key is named here (a file or an environment variable), never written: it is read at start and sent
    only to this endpoint, never logged or shown."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    name: Name
    base_url: str = Field(min_length=1, max_length=2000)  # e.g. "http://192.168.1.20:8080/v1"
    socket: Path | None = Field(default=None, strict=False)  # reach base_url over this Unix socket
    api_key_file: Path | None = Field(default=None, strict=False)
    api_key_env: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    model: ModelName | None = None  # the upstream's model for every request (absent: the request's own)
    models: dict[ModelName, ModelName] = Field(default_factory=dict, max_length=1000)  # request's model -> upstream's
    timeout_s: float = Field(default=60.0, gt=0, le=3600)  # connect + first token, and between two tokens
    order: int = Field(default=0, ge=0, le=1_000_000)  # lower first; ties keep the file's order
    retry_after_s: float = Field(default=30.0, ge=0, le=3600)  # after a failure, skipped this long

    @field_validator("base_url")
    @classmethod
    def _url(cls, url: str) -> str:
        """Checked here rather than at the first request (issue 33: port 99999, port 0, a CRLF or a space in the host
        started fine and every routed request then got a plain-text 500)."""
        if any(c.isspace() or not c.isprintable() for c in url):
            raise ValueError(f"{url!r}: no spaces or control characters in a URL")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: an http:// or https:// URL with a host (e.g. http://localhost:8080/v1)")
        if not _HOST.fullmatch(parts.hostname):
            raise ValueError(f"{url!r}: {parts.hostname!r} is not a host name or an IP address")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"{url!r}: the port must be a number from 1 to 65535") from None
        if port == 0:
            raise ValueError(f"{url!r}: the port must be a number from 1 to 65535")
        if parts.username or parts.password:
            raise ValueError("put credentials in api_key_file or api_key_env, not in the URL")
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: no query or fragment (the API paths are appended to it)")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _one_key(self) -> Upstream:
        if self.api_key_file is not None and self.api_key_env is not None:
            raise ValueError("api_key_file or api_key_env, not both")
        return self


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
    upstream: tuple[Upstream, ...] = Field(default=(), max_length=32, strict=False)  # TOML [[upstream]]
    # What serves the tokens (docs/engines.md): the built-in llama-cpp-python child, llama.cpp's own llama-server
    # (the program: `llama_server`, default found on the PATH then beside python), or a server the user runs.
    engine: Literal["llama-cpp-python", "llama-server", "external"] = "llama-cpp-python"
    llama_server: Path | None = Field(default=None, strict=False)
    engine_url: str | None = Field(default=None, min_length=1, max_length=2000)  # engine = "external"
    # engine = "external": the server's model name for each ladder tier ([engine_models] large = "llama3.1:8b")
    engine_models: dict[ModelName, ModelName] = Field(default_factory=dict, max_length=100)

    @model_validator(mode="after")
    def _engine_url(self) -> DaemonConfig:
        if (self.engine == "external") != (self.engine_url is not None):
            raise ValueError('engine_url is what an external engine needs, and only it (engine = "external")')
        return self

    @field_validator("upstream")
    @classmethod
    def _unique(cls, upstreams: tuple[Upstream, ...]) -> tuple[Upstream, ...]:
        names = [u.name for u in upstreams]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"two upstreams named {dup!r}")
        return tuple(sorted(upstreams, key=lambda u: u.order))

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
