"""`termux-battery-status` (Termux:API) in a background thread: the loop reads the last good result and its age.

The command takes about 1 s, sometimes 7 s, and can hang, so it runs with a timeout in its own process group (its
helper processes die with it) and nothing that samples ever waits for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from sensors.root import MAX_SANE_C, MIN_SANE_C
from sensors.snapshot import Battery, Problem

DEFAULT_COMMAND = ("termux-battery-status",)


def termux_detected(environ: Mapping[str, str] = os.environ) -> bool:
    return "TERMUX_VERSION" in environ or "com.termux" in environ.get("PREFIX", "")


class TermuxStatus(BaseModel):
    """The fields of termux-battery-status we use; the app adds others across versions, so extras are ignored."""

    model_config = ConfigDict(extra="ignore")

    percentage: float | None = None
    status: str | None = None  # CHARGING, DISCHARGING, FULL, NOT_CHARGING, UNKNOWN
    plugged: str | None = None  # UNPLUGGED, PLUGGED_AC, PLUGGED_USB, PLUGGED_WIRELESS
    temperature: float | None = None  # °C
    current: float | None = None  # µA, the sign differs between devices
    voltage: float | None = None  # mV


def to_battery(status: TermuxStatus) -> tuple[Battery, str | None]:
    """The battery reading and, when the temperature is absurd, why it was dropped."""
    temp = status.temperature
    complaint = None
    if temp is not None and not MIN_SANE_C <= temp <= MAX_SANE_C:
        complaint = f"absurd: temperature {temp:g} °C is outside {MIN_SANE_C:g}..{MAX_SANE_C:g} °C"
        temp = None
    power = None
    if status.current is not None and status.voltage is not None:
        power = abs(status.current) * status.voltage / 1e9
    charging = {"CHARGING": True, "DISCHARGING": False, "FULL": False, "NOT_CHARGING": False}.get(status.status or "")
    plugged = None if status.plugged is None else status.plugged != "UNPLUGGED"
    percent = status.percentage if status.percentage is not None and 0 <= status.percentage <= 100 else None
    battery = Battery(percent=percent, charging=charging, plugged=plugged, power_w=power, temp_c=temp, source="termux")
    return battery, complaint


class TermuxBattery:
    def __init__(
        self,
        command: Sequence[str] = DEFAULT_COMMAND,
        *,
        timeout_s: float = 3.0,
        refresh_s: float = 5.0,
        max_age_s: float = 120.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.command = list(command)
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.max_age_s = max_age_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._good: tuple[Battery, float] | None = None
        self._error: str | None = None
        self._first = threading.Event()
        self.runs = 0  # completed attempts, successful or not

    @property
    def name(self) -> str:
        return os.path.basename(self.command[0]) if self.command else "termux-battery-status"

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="termux-battery-status", daemon=True)
            self._thread.start()

    def wait_first(self, timeout_s: float) -> bool:
        """For one-shot callers (the CLI), not the loop: wait until the first attempt has finished."""
        self.start()
        return self._first.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 1)

    def latest(self) -> tuple[Battery | None, list[Problem]]:
        """Never blocks: the last good reading with its age, and the last failure if the latest attempt failed."""
        self.start()
        with self._lock:
            good, error = self._good, self._error
        problems = [Problem(path=self.name, reason=error)] if error else []
        if good is None:
            return None, problems
        battery, at = good
        age = self._monotonic() - at
        if age > self.max_age_s:
            problems.append(Problem(path=self.name, reason=f"stale: last good result is {age:.0f} s old"))
            return None, problems
        return battery.model_copy(update={"age_s": round(age, 3)}), problems

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.refresh_s)

    def poll_once(self) -> None:
        battery, error = self._call()
        with self._lock:
            if battery is not None:
                self._good = (battery, self._monotonic())
            self._error = error
            self.runs += 1
        self._first.set()

    def _call(self) -> tuple[Battery | None, str | None]:
        try:
            proc = subprocess.Popen(
                self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
        except OSError as exc:
            return None, f"cannot run {' '.join(self.command)}: {exc.strerror or exc}"
        with self._lock:
            self._proc = proc
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return None, f"timed out after {self.timeout_s:g} s"
        finally:
            with self._lock:
                self._proc = None
        if proc.returncode != 0:
            detail = err.decode(errors="replace").strip().splitlines()
            return None, f"exit status {proc.returncode}" + (f": {detail[0][:80]}" if detail else "")
        try:
            status = TermuxStatus.model_validate(json.loads(out))
        except json.JSONDecodeError:
            return None, f"not JSON: {out.decode(errors='replace').strip()[:40]!r}"
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "top level"
            return None, f"unexpected JSON at {where}: {first['msg']}"
        return to_battery(status)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
