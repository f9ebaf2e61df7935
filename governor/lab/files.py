"""Loading the lab's TOML files (devices, workloads): by shipped name or by path, validated with one-line errors."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from governor.errors import GovernorError
from policies.loader import locate  # the policy files' line finder: tomllib keeps no positions

M = TypeVar("M", bound=BaseModel)

HERE = Path(__file__).parent


class LabFileError(GovernorError):
    def __init__(self, path: Path | str, reason: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")
        self.path = Path(path)
        self.reason = reason
        self.line = line


def shipped(kind: str) -> list[str]:
    """Names of the files shipped in governor/lab/<kind>/ (e.g. "devices")."""
    return sorted(p.stem for p in (HERE / kind).glob("*.toml"))


def resolve(kind: str, name_or_file: str) -> Path:
    """A shipped name ("raspberry-pi-5") or a path to a TOML file."""
    path = Path(name_or_file)
    if path.suffix == ".toml" or path.exists() or "/" in name_or_file:
        return path
    candidate = HERE / kind / f"{name_or_file}.toml"
    if not candidate.exists():
        raise LabFileError(name_or_file, f"no such {kind[:-1]}; shipped: {', '.join(shipped(kind))}")
    return candidate


def load_model(path: Path, model: type[M]) -> M:
    try:
        text = path.read_text()
    except OSError as exc:
        raise LabFileError(path, f"cannot read: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LabFileError(path, f"not valid TOML: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(top)"
        raise LabFileError(path, f"{loc}: {err['msg']}", locate(text, err["loc"])) from exc
