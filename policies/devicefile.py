"""The device model's file (`governor bench-device` writes it, `governor run --device-model FILE` reads it): the prior
of the hot state's device model (policies/devicemodel.py, `[power]`'s fields) and every measurement behind it."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govbase.errors import GovernorError
from policies.decision import KvType
from policies.schema import Power


class Measured(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tier: str
    kv_type: KvType
    threads: int = Field(ge=1)
    freq_ratio: float = Field(gt=0, le=1)
    ctx_fill: int = Field(ge=0)
    tokens_per_s: float = Field(ge=0)
    ttft_s: float = Field(ge=0)
    rss_mb: float = Field(ge=0)
    j_per_token: float | None = Field(default=None, ge=0)


class DeviceFile(BaseModel):
    """What `bench-device` writes and the daemon reads: the prior, and every measurement behind it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    power: Power
    run: tuple[Measured, ...] = ()


def load_device_model(path: Path) -> Power:
    """The `[power]` prior from a bench-device TOML; one clear line when the file is wrong."""
    try:
        data = tomllib.loads(path.read_text())
        return DeviceFile.model_validate(data).power
    except OSError as exc:
        raise GovernorError(f"{path}: cannot read: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise GovernorError(f"{path}: not valid TOML: {exc}") from exc
    except ValidationError as exc:
        err = exc.errors()[0]
        raise GovernorError(f"{path}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from exc
