"""What an actuator found before its first write, kept in the state directory until it has put it back.

Written once for every actuator that changes something outside the daemon (tuned's way): `save` before the first
write (atomically and fsync'd: a power cut mid-write leaves the old file or the new, never half of one), `clear` once
restored, and at the next start `load` gives what a crashed run (kill -9, a power cut) left for the actuator to put
back. The file is trusted only when it is this user's own (owner, not writable by others, not a symlink): run as root,
a planted file must not make the daemon write anything anywhere; each actuator also checks that every entry names a
file it writes itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any


class Originals:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.saved = False  # by this run, and not cleared yet

    def save(self, values: dict[str, Any]) -> None:
        """Persist `values` (JSON) as a new file of our own (O_EXCL, 0600: never one someone else put or linked
        there), renamed over the old one; raises OSError."""
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(values, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.saved = True

    def load(self) -> dict[str, Any] | None:
        """What a previous run saved and did not clear; None when there is nothing. Raises ValueError (not our own
        file, not a JSON object) or OSError."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode):
                raise ValueError(f"not this user's own file (owner uid {st.st_uid}, mode {st.st_mode & 0o7777:o})")
            data = json.loads(os.read(fd, 1 << 20).decode())
        finally:
            os.close(fd)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.saved = False
