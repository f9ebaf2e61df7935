"""Runs inside an umockdev testbed (LD_PRELOAD + UMOCKDEV_DIR), started by udev_driver.py: prints each uevent."""

from __future__ import annotations

import sys

from governor import logs
from sensors.events import UdevEvent, UdevEvents

seen: list[UdevEvent] = []


def on_event(event: UdevEvent) -> None:
    seen.append(event)
    print(f"event {event.action} {event.subsystem} {event.name}", flush=True)
    if len(seen) == 1:
        raise RuntimeError("a failing callback must not end the monitor")


def main() -> None:
    logs.configure(json=True, stream=sys.stderr)
    watcher = UdevEvents(on_event)
    print("ready" if watcher.start() else "polling", flush=True)
    sys.stdin.readline()  # the driver closes stdin when it is done
    watcher.stop()


if __name__ == "__main__":
    main()
