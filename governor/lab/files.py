"""Loading the lab's TOML files (devices, workloads): by shipped name or by path, validated with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from policies.loader import TomlFileError, load_toml_model

M = TypeVar("M", bound=BaseModel)

HERE = Path(__file__).parent


class LabFileError(TomlFileError):
    """A device or workload file that cannot be found, read, parsed or validated."""


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
    return load_toml_model(path, model, LabFileError)
