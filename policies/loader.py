"""Load a policy TOML: a shipped profile by name or a file; a mistake is one line "FILE:LINE: field.path: message"."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from governor.errors import GovernorError
from policies.schema import Policy

PROFILES_DIR = Path(__file__).parent / "profiles"

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")
_TOML_LINE = re.compile(r"at line (\d+)")


M = TypeVar("M", bound=BaseModel)


class TomlFileError(GovernorError):
    """A TOML file (ladder, device, workload) that cannot be read, parsed or validated: "FILE[:LINE]: reason"."""

    def __init__(self, path: Path | str, reason: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")
        self.path = Path(path)
        self.reason = reason
        self.line = line


def load_toml_model(path: Path, model: type[M], error: type[TomlFileError] = TomlFileError) -> M:
    """Read, parse and validate `path` as `model`; any mistake is one `error` naming the file, line and field."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(path, f"cannot read: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(path, f"not valid TOML: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top)"
        raise error(path, f"{field}: {err['msg']}", locate(text, err["loc"])) from exc


class PolicyError(GovernorError):
    def __init__(self, path: Path | str, line: int | None, field: str, reason: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {field}: {reason}" if field else f"{where}: {reason}")
        self.path = Path(path)
        self.line = line
        self.field = field
        self.reason = reason


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def resolve(name_or_file: str | Path) -> Path:
    """A shipped profile name, else a path."""
    if isinstance(name_or_file, str) and "/" not in name_or_file and not name_or_file.endswith(".toml"):
        shipped = PROFILES_DIR / f"{name_or_file}.toml"
        if shipped.is_file():
            return shipped
        if not Path(name_or_file).exists():
            raise PolicyError(name_or_file, None, "", f"no such policy file or profile (shipped: {shipped_profiles()})")
    return Path(name_or_file)


def _split_key(key: str) -> list[str]:
    # Quoted keys containing dots are not supported here; policy keys never need them.
    return [part.strip().strip("\"'") for part in key.split(".")]


def locate(text: str, loc: Sequence[str | int]) -> int | None:
    """The 1-based line of the key or table header that best matches a pydantic error location, or None.

    tomllib gives no positions, so this tracks table headers and (dotted) keys line by line and keeps the line whose
    full key path is the longest prefix of `loc` (first wins). Inline tables count as their key's line.
    """
    want = [str(p) for p in loc if not isinstance(p, int)]
    table: list[str] = []
    best_line, best_len = None, 0
    for number, line in enumerate(text.splitlines(), start=1):
        if (header := _HEADER.match(line)) is not None:
            table = _split_key(header.group(1))
            path = table
        elif (key := _KEY.match(line)) is not None:
            path = table + _split_key(key.group(1))
        else:
            continue
        if want[: len(path)] == path:
            score = len(path)
        elif path[: len(want)] == want:
            score = len(want)  # a table's sub-table stands for the table itself: `states` -> `[states.idle]`
        else:
            continue
        if score > best_len:
            best_line, best_len = number, score
    return best_line


def parse_policy(text: str, path: Path | str) -> Policy:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = _TOML_LINE.search(str(exc))
        raise PolicyError(path, int(found.group(1)) if found else None, "", f"not valid TOML: {exc}") from exc
    data.setdefault("name", Path(path).stem)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        loc = err["loc"]
        field = ".".join(str(p) for p in loc)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (a typo?)"
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more)"
        raise PolicyError(path, locate(text, loc) or 1, field or "policy", msg) from exc


def load_policy(name_or_file: str | Path) -> Policy:
    """A shipped profile (`default`, `raspberry-pi`, ...) or a TOML file; raises PolicyError on any mistake."""
    path = resolve(name_or_file)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(path, None, "", f"cannot read: {exc.strerror}") from exc
    return parse_policy(text, path)
