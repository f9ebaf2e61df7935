"""Run by Debian's /usr/bin/python3 (gi + UMockdev) under libumockdev-preload: a testbed with a battery at 15 %
charging from mains and a thermal zone; starts `governor run --root TESTBED ...` inside it, then pulls the charger
with a real uevent when told to.

Usage: udev_daemon_driver.py LOG GOVERNOR-ARGV... ("@ROOT@" in the argv becomes the testbed's root directory).
Stdin commands: "pull" (prints "pulled"), "quit". Prints "root DIR" once the daemon is started.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gi  # type: ignore[import-not-found]

gi.require_version("UMockdev", "1.0")
from gi.repository import UMockdev  # type: ignore[import-not-found]  # noqa: E402


def main() -> None:
    log_path, argv = sys.argv[1], sys.argv[2:]
    bed = UMockdev.Testbed.new()
    mains = bed.add_device("power_supply", "AC", None, ["type", "Mains", "online", "1"], ["POWER_SUPPLY_ONLINE", "1"])
    battery = bed.add_device(
        "power_supply",
        "BAT0",
        None,
        ["type", "Battery", "present", "1", "status", "Charging", "capacity", "15", "power_now", "5000000"],
        [],
    )
    attrs = ["type", "cpu-thermal", "temp", "45000", "trip_point_0_type", "passive", "trip_point_0_temp", "80000"]
    bed.add_device("thermal", "thermal_zone0", None, attrs, [])
    root = bed.get_root_dir()
    env = {**os.environ, "UMOCKDEV_DIR": root}  # GLib's setenv does not reach os.environ
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen([a.replace("@ROOT@", root) for a in argv], env=env, stdout=log, stderr=log)
    print(f"root {root}", flush=True)
    for line in sys.stdin:
        if line.strip() == "pull":
            bed.set_attribute(mains, "online", "0")
            bed.set_attribute(battery, "status", "Discharging")
            bed.uevent(mains, "change")
            print("pulled", flush=True)
        elif line.strip() == "quit":
            break
    daemon.terminate()
    daemon.wait(60)


if __name__ == "__main__":
    main()
