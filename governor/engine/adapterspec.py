"""What the engine's model needs to know of a LoRA adapter (governor.engine.adapters owns the pool): its spec, read
from its file, and the error a request gets when it cannot run. Apart from the pool, so that the model does not import
the pool that drives it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


class AdapterError(Exception):
    """A request's adapter that cannot run now: `status` and `code` for the API's error."""

    def __init__(self, message: str, *, status: int, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


@dataclass(frozen=True)
class AdapterSpec:
    """A ladder adapter as its file says: what it takes in the pool, or why it cannot be used."""

    name: str
    path: Path
    base: str  # the tier it was trained for
    scale: float
    bytes: int  # its tensors: the pool memory it takes once loaded
    arch: str | None  # general.architecture
    error: str | None = None  # None: usable

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "base": self.base, "scale": self.scale, "bytes": self.bytes, "error": self.error}
