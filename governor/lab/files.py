"""Loading the lab's TOML files (devices, workloads): by shipped name or by path, validated with one-line errors."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from governor.errors import GovernorError

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


def _line_of(text: str, key: str) -> int | None:
    """The first line assigning `key` or opening table `[key]`: tomllib keeps no positions, so search the text."""
    pattern = re.compile(rf"^\s*(\[\[?\s*([\w.-]+\.)?{re.escape(key)}\s*\]\]?|{re.escape(key)}\s*=)", re.MULTILINE)
    match = pattern.search(text)
    return text.count("\n", 0, match.start()) + 1 if match else None


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
        loc = [str(p) for p in err["loc"]]
        keys = [p for p in loc if not p.isdigit()]
        line = _line_of(text, keys[-1]) if keys else None
        raise LabFileError(path, f"{'.'.join(loc) or '(top)'}: {err['msg']}", line) from exc
