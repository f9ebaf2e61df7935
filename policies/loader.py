"""Load a policy TOML: a shipped profile by name or a file; a mistake is one line "FILE:LINE: field.path: message"."""

from __future__ import annotations

import os
import re
import stat
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from govbase.errors import GovernorError
from policies.schema import Policy

PROFILES_DIR = Path(__file__).parent / "profiles"

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")
_TOML_LINE = re.compile(r"at line (\d+)")


M = TypeVar("M", bound=BaseModel)

MAX_FILE_BYTES = 1 << 20  # a policy, ladder or config file is a few KB; 1 MiB is generous
MAX_MESSAGE = 300  # a validation message quotes the input; keep the one line short


class UnreadableText(ValueError):
    """A file refused before parsing; `reason` says why in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_text(path: Path, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The file's text, refusing before any parser sees it: not a regular file (a FIFO would block the reader
    forever, a device could be endless), larger than `max_bytes`, binary (NUL bytes) or not UTF-8."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise UnreadableText(f"cannot read: {exc.strerror}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
        raise UnreadableText(f"not a regular file ({kind})")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise UnreadableText(f"cannot read: {exc.strerror}") from exc
    if len(data) > max_bytes:
        raise UnreadableText(f"too large (over {max_bytes} bytes); not a configuration file")
    if (nul := data.find(b"\0")) >= 0:
        raise UnreadableText(f"binary data (a NUL byte at offset {nul}), not a text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableText(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def parse_toml(text: str) -> dict[str, Any]:
    """tomllib, with every way it can fail as one TOMLDecodeError: it raises RecursionError on deep nesting and
    ValueError on an integer of more than 4300 digits."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise tomllib.TOMLDecodeError("nested too deeply") from None
    except tomllib.TOMLDecodeError:
        raise
    except ValueError as exc:
        raise tomllib.TOMLDecodeError(str(exc)[:MAX_MESSAGE]) from None


def validation_message(msg: str) -> str:
    return msg.removeprefix("Value error, ")[:MAX_MESSAGE]


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
        text = read_text(path)
    except UnreadableText as exc:
        raise error(path, exc.reason) from exc
    try:
        data = parse_toml(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(path, f"not valid TOML: {exc}") from exc
    try:
        return model.model_validate(data)
    except (ValidationError, RecursionError) as exc:
        if isinstance(exc, RecursionError):
            raise error(path, "nested too deeply") from None
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top)"
        raise error(path, f"{field}: {validation_message(err['msg'])}", locate(text, err["loc"])) from exc


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
        data = parse_toml(text)
    except tomllib.TOMLDecodeError as exc:
        found = _TOML_LINE.search(str(exc))
        raise PolicyError(path, int(found.group(1)) if found else None, "", f"not valid TOML: {exc}") from exc
    data.setdefault("name", Path(path).stem)
    try:
        return Policy.model_validate(data)
    except RecursionError:
        raise PolicyError(path, None, "", "nested too deeply") from None
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        loc = err["loc"]
        field = ".".join(str(p) for p in loc)
        msg = validation_message(err["msg"])
        if err["type"] == "extra_forbidden":
            msg = "unknown key (a typo?)"
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more)"
        raise PolicyError(path, locate(text, loc) or 1, field or "policy", msg) from exc


def load_policy(name_or_file: str | Path) -> Policy:
    """A shipped profile (`default`, `raspberry-pi`, ...) or a TOML file; raises PolicyError on any mistake."""
    path = resolve(name_or_file)
    try:
        text = read_text(path)
    except UnreadableText as exc:
        raise PolicyError(path, None, "", exc.reason) from exc
    return parse_policy(text, path)
