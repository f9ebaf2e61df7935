"""Wake the loop at once on udev uevents (charger plugged or pulled, a thermal zone crossing a trip).

pyudev's MonitorObserver delivers events on its own thread; the callback should only set a flag or an Event (the
daemon passes `loop.wake.set`). Where udev does not run (containers, Termux, no libudev) this says so once and the
loop keeps polling on its interval.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

DEFAULT_SUBSYSTEMS = ("power_supply", "thermal")
UDEV_CONTROL = "/run/udev/control"


@dataclass(frozen=True, slots=True)
class UdevEvent:
    action: str  # "add", "remove", "change"
    subsystem: str
    name: str  # the device's sys_name, e.g. "AC" or "thermal_zone0"


def udev_running(control: str = UDEV_CONTROL, environ: Mapping[str, str] = os.environ) -> bool:
    """libudev monitors only hear udevd's broadcasts; an umockdev testbed (UMOCKDEV_DIR) emulates them."""
    return os.path.exists(control) or "UMOCKDEV_DIR" in environ


class UdevEvents:
    def __init__(
        self,
        callback: Callable[[UdevEvent], None],
        subsystems: Sequence[str] = DEFAULT_SUBSYSTEMS,
        *,
        control: str = UDEV_CONTROL,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self.callback = callback
        self.subsystems = tuple(subsystems)
        self._control = control
        self._environ = environ
        self._observer: Any = None
        self._log = structlog.get_logger("sensors.events")

    @property
    def active(self) -> bool:
        return self._observer is not None

    def start(self) -> bool:
        """True when uevents will arrive; False (said once, in the log) when the caller must rely on polling."""
        if self._observer is not None:
            return True
        if not udev_running(self._control, self._environ):
            return self._fallback(f"udev is not running ({self._control} is absent)")
        try:
            import pyudev

            monitor = pyudev.Monitor.from_netlink(pyudev.Context())
            for subsystem in self.subsystems:
                monitor.filter_by(subsystem)
            monitor.start()  # bound before start() returns, so no event between start() and the thread is lost
            observer = pyudev.MonitorObserver(monitor, callback=self._deliver, name="udev-events")
            observer.daemon = True
            observer.start()
        except (ImportError, OSError) as exc:  # no libudev (Termux), netlink refused (some containers)
            return self._fallback(f"cannot monitor udev: {exc}")
        self._observer = observer
        self._log.info("udev_events", subsystems=list(self.subsystems))
        return True

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer = None

    def _fallback(self, reason: str) -> bool:
        self._log.info("udev_unavailable", reason=reason, fallback="polling")
        return False

    def _deliver(self, device: Any) -> None:
        event = UdevEvent(str(device.action), str(device.subsystem), str(device.sys_name))
        try:
            self.callback(event)
        except Exception:
            # An exception here would end pyudev's observer thread and silently stop every later wake-up.
            self._log.exception("udev_callback_failed", action=event.action, subsystem=event.subsystem)
