"""Unix-socket paths shared by the engine's chat socket and the daemon's control socket."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from governor.errors import GovernorError


def clear_stale_socket(
    path: Path, error: Callable[[str], GovernorError], *, in_use: str = "another process is serving on it"
) -> None:
    """Remove a socket file nobody answers on (left by a process that died); refuse anything else.

    A regular file or directory at `path` is never removed, and a live listener is never displaced: both raise
    `error(reason)`, so each caller words its own one-line message.
    """
    if not (path.is_symlink() or path.exists()):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise error("exists and is not a socket; not removing it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return
        except OSError as exc:
            raise error(f"cannot check the existing socket: {exc.strerror}") from exc
    raise error(in_use)
