"""sd_notify(3) over $NOTIFY_SOCKET: READY, STATUS, WATCHDOG, RELOADING, STOPPING.

Written here rather than pulled in (it is a datagram to a path or an abstract '@' socket); a no-op when the
daemon is not started by systemd, so the same code runs under a terminal, runit or a test.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

import structlog

SEND_TIMEOUT_S = 1.0


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "")
        # An abstract socket is spelled with a leading '@' in the environment and a NUL byte on the wire.
        self._address = ("\0" + path[1:]) if path.startswith("@") else path
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        wanted = usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_interval_s: float | None = int(usec) / 1e6 / 2 if wanted else None
        self._last_ping = float("-inf")
        self._log = structlog.get_logger("governor.notify")

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, **fields: str | int) -> bool:
        """`send(READY=1, STATUS="hot")` sends "READY=1\\nSTATUS=hot"; False when there is nobody to tell."""
        if not self._address:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)  # a congested receiver costs a message, never a stalled loop
                sock.sendto(message, self._address)
        except OSError as exc:
            self._log.warning("sd_notify failed", socket=self._address.replace("\0", "@"), error=str(exc))
            return False
        return True

    def ready(self, status: str) -> None:
        self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def reloading(self) -> None:
        # systemd >= 253 wants MONOTONIC_USEC with RELOADING for Type=notify-reload; older ones ignore it.
        self.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def reloaded(self, status: str) -> None:
        self.send(READY=1, STATUS=status)

    def stopping(self, status: str = "stopping") -> None:
        self.send(STOPPING=1, STATUS=status)

    def watchdog(self, now_s: float) -> None:
        """Ping at most every half WatchdogSec (or every call when systemd did not say how often)."""
        if self.watchdog_interval_s is not None and now_s - self._last_ping < self.watchdog_interval_s:
            return
        if self.send(WATCHDOG=1):
            self._last_ping = now_s
