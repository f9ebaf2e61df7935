"""Unix-socket paths shared by the engine's chat socket, the daemon's public chat socket and its control socket."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from govbase.errors import GovernorError


def private_dir_problem(path: Path, euid: int | None = None) -> str | None:
    """Why `path` may not hold our sockets, or None: it must be a real directory (not a symlink) owned by us or
    root, writable by no one else (OpenSSH's and tmux's rule). Otherwise another user could replace a socket."""
    euid = os.geteuid() if euid is None else euid
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: cannot check: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path}: not a directory (a symlink or file); refusing to put sockets there"
    if st.st_uid not in (euid, 0):
        return f"{path}: owned by uid {st.st_uid}, not by us (uid {euid}); refusing to put sockets there"
    if st.st_mode & 0o022:
        who = {0o022: "group and others", 0o020: "group", 0o002: "others"}[st.st_mode & 0o022]
        return (
            f"{path}: writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}); refusing to put sockets there "
            "(chmod go-w, or remove it)"
        )
    return None


def check_private_dir(path: Path, error: Callable[[str], GovernorError]) -> None:
    problem = private_dir_problem(path)
    if problem is not None:
        raise error(problem)


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


def bind_unix(path: Path, mode: int, error: Callable[[str], GovernorError], *, gid: int = -1) -> socket.socket:
    """A bound (not yet listening) stream socket at `path`, with the final mode from the first instant (umask),
    then set explicitly, and group `gid` (-1: ours). A leftover socket file is removed only when nothing answers
    on it."""
    clear_stale_socket(path, error)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise error(f"cannot bind: {exc.strerror}") from exc
    finally:
        os.umask(old)
    if gid != -1:
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    return sock
