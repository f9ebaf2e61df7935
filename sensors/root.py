"""One root prefix for every /sys and /proc path, and a tolerant reader that turns faults into `Problem`s.

Like psutil's `cat(path, fallback=None)`: a broken file costs one reading, never the sample. A test swaps in a
`Root` subclass whose `read` raises the `OSError` it wants for chosen paths.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import weakref
from collections.abc import Iterator
from pathlib import Path

from sensors.snapshot import Problem

# Outside this range a temperature is a broken sensor, not a reading (vendor kernels and stuck sensors do this).
MIN_SANE_C = -40.0
MAX_SANE_C = 150.0


class EscapedRoot(PermissionError):
    """A write whose path resolves outside the root's sys/ tree (a symlink out of it): refused, never written."""


class Root:
    """Maps kernel paths ("sys/class/thermal") to paths under the prefix; the only place files are opened."""

    def __init__(self, prefix: Path | str = "/") -> None:
        self.prefix = Path(prefix)
        self._base = str(self.prefix).rstrip("/")
        self._sys = os.path.realpath(f"{self._base}/sys") + "/"  # where every write must land (resolved once)
        self._held: dict[str, int] = {}  # path -> descriptor kept open for re-reading (see `holding`)
        # A held file can be renamed over only in a fake tree; the kernel's attributes fail their read once removed.
        self._renamable = bool(self._base)
        self._holding = False
        weakref.finalize(self, _close_all, self._held)  # a sampler dropped without close() leaks no descriptor

    def path(self, rel: str) -> str:
        return f"{self._base}/{rel.lstrip('/')}"

    def display(self, path: str) -> str:
        """The kernel path a user recognises ("/sys/class/thermal/thermal_zone0/temp"), without the prefix."""
        return path[len(self._base) :] if path.startswith(self._base + "/") else path

    def shown(self, rel: str) -> str:
        """A path for messages: the real one, so that `--root DIR` users see what was looked at."""
        return self.path(rel) if self._base else "/" + rel.lstrip("/")

    def read(self, path: str) -> bytes:
        # os.open/os.read: no text-layer or buffer setup; a sample reads ~100 small files.
        if self._holding:
            fd = self._held.get(path)
            if fd is not None:
                try:
                    if not self._renamable or os.fstat(fd).st_nlink:  # 0: deleted or renamed over: open it again
                        return os.pread(fd, 65536, 0)
                except OSError:  # e.g. ENODEV: the device went away; opening the path again says how
                    pass
                del self._held[path]
                os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in a fake tree must not block the sample
        keep = False
        try:
            data = os.read(fd, 65536)
            keep = self._holding and stat.S_ISREG(os.fstat(fd).st_mode)
            return data
        finally:
            if keep:
                self._held[path] = fd
            else:
                os.close(fd)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Reads in this block keep their regular files open and read them again with pread(2) next time: the
        sampler's per-tick files (sysfs and procfs make a fresh value at offset 0, as poll()-able attributes are read;
        it saves open and close, most of a small file's cost). A descriptor whose read fails (a removed attribute:
        ENODEV) or, under a prefix, whose file was deleted or renamed over (an fstat per read there) is closed and the
        path opened again; `release()` (at every discovery and on close) closes them all."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def release(self) -> None:
        _close_all(self._held)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def writable(self, path: str) -> bool:
        """May this process write the file (the actuators' check; False on a read-only /sys, without root, or when
        the path leads out of the root's sys/ tree)."""
        return self.confined(path) and os.access(path, os.W_OK)

    def confined(self, path: str) -> bool:
        return os.path.realpath(path).startswith(self._sys)

    def write(self, path: str, data: bytes) -> None:
        """The actuators' one write: sysfs attributes take a whole value in one write(2).

        Confined to the root's `sys/` (issue 33): a `policy0` directory or a `scaling_max_freq` that is a symlink
        out of the tree had the cap written into the outside file. What was opened (not what the path said: no race
        with a link swapped after a check) must be a regular file under the root's `sys/`, else `EscapedRoot`;
        O_NONBLOCK, so a FIFO planted there cannot hang the loop."""
        if not self.confined(path):  # checked before opening too: opening a device can do something
            raise EscapedRoot(errno.EPERM, f"resolves to {os.path.realpath(path)}, outside {self._sys}", path)
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            opened = os.readlink(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else os.path.realpath(path)
            if not opened.startswith(self._sys) or not stat.S_ISREG(os.fstat(fd).st_mode):
                raise EscapedRoot(errno.EPERM, f"resolves to {opened}, not a file under {self._sys}", path)
            os.write(fd, data)
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_live(self) -> bool:
        """True when reading the running system itself (prefix "/"), so psutil's figures describe the same machine."""
        return not self._base


def _close_all(held: dict[str, int]) -> None:
    for fd in held.values():
        os.close(fd)
    held.clear()


def describe(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "error")
    return f"{name}: {exc.strerror or exc}"


class Reader:
    """Reads for one sample (or one discovery) and collects what went wrong."""

    __slots__ = ("denied", "problems", "root", "vanished")

    def __init__(self, root: Root) -> None:
        self.root = root
        self.problems: list[Problem] = []
        self.vanished = False  # a file listed at discovery is gone: rediscover before the next sample
        self.denied: list[str] = []  # files discovery left out because reading them is not permitted

    def problem(self, path: str, reason: str) -> None:
        self.problems.append(Problem(path=self.root.display(path), reason=reason))

    def text(self, path: str) -> str | None:
        try:
            raw = self.root.read(path)
        except FileNotFoundError:
            self.vanished = True
            self.problem(path, "vanished: no such file (rediscovering)")
            return None
        except OSError as exc:
            self.problem(path, describe(exc))
            return None
        text = raw.decode("utf-8", "replace").strip()
        if not text:
            self.problem(path, "empty")
            return None
        return text

    def is_denied(self, path: str) -> bool:
        """Discovery's trial read. Many phones' SELinux policy denies dozens of thermal zones, battery and cpufreq
        files: reporting each in every sample would bury the real problems, so they are reported once per discovery
        and left out."""
        try:
            self.root.read(path)
        except PermissionError as exc:
            self.problem(path, f"{describe(exc)}; left out until the next discovery")
            self.denied.append(path)
            return True
        except OSError:
            return False  # other faults may be transient: the samples report them
        return False

    def optional_text(self, path: str) -> str | None:
        """For files that many devices lack (a label, a trip): absent is normal, other faults are problems."""
        try:
            raw = self.root.read(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.problem(path, describe(exc))
            return None
        return raw.decode("utf-8", "replace").strip() or None

    def number(self, path: str) -> float | None:
        text = self.text(path)
        return None if text is None else self.parse(path, text)

    def parse(self, path: str, text: str) -> float | None:
        try:
            value = float(text)
        except ValueError:
            self.problem(path, f"not a number: {text[:40]!r}")
            return None
        if not math.isfinite(value):
            self.problem(path, f"not a number: {text[:40]!r}")
            return None
        return value

    def sane_c(self, path: str, temp_c: float) -> float | None:
        if MIN_SANE_C <= temp_c <= MAX_SANE_C:
            return temp_c
        self.problem(path, f"absurd: {temp_c:g} °C is outside {MIN_SANE_C:g}..{MAX_SANE_C:g} °C")
        return None

    def listdir(self, path: str, *, optional: bool = True) -> list[str]:
        """A directory's entries; a missing directory is an empty one (no such hardware), other faults are problems."""
        try:
            return self.root.listdir(path)
        except FileNotFoundError:
            if not optional:
                self.problem(path, "vanished: no such directory")
            return []
        except OSError as exc:
            self.problem(path, describe(exc))
            return []
