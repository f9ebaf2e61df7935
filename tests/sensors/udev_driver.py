"""Run by Debian's /usr/bin/python3 (it has gi + UMockdev) under libumockdev-preload: builds a testbed with a
mains supply, a thermal zone and an input device, starts udev_child.py in it and sends real uevents.

Usage: udev_driver.py PYTHON CHILD_SCRIPT. Prints the child's lines; the test asserts on them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gi  # type: ignore[import-not-found]

gi.require_version("UMockdev", "1.0")
from gi.repository import UMockdev  # type: ignore[import-not-found]  # noqa: E402


def main() -> None:
    python, child_script = sys.argv[1:3]
    bed = UMockdev.Testbed.new()
    mains = bed.add_device("power_supply", "AC", None, ["type", "Mains", "online", "1"], ["POWER_SUPPLY_ONLINE", "1"])
    zone = bed.add_device("thermal", "thermal_zone0", None, ["type", "cpu-thermal", "temp", "45000"], [])
    mouse = bed.add_device("input", "mouse0", None, ["name", "mouse"], [])
    env = {**os.environ, "UMOCKDEV_DIR": bed.get_root_dir()}  # GLib's setenv does not reach os.environ
    child = subprocess.Popen([python, child_script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdin is not None
    print(child.stdout.readline().strip(), flush=True)
    bed.uevent(mouse, "change")  # not a subscribed subsystem: must not arrive
    bed.set_attribute(mains, "online", "0")
    bed.uevent(mains, "change")  # the charger pulled
    print(child.stdout.readline().strip(), flush=True)
    bed.uevent(zone, "change")  # arrives although the previous callback raised
    print(child.stdout.readline().strip(), flush=True)
    child.stdin.close()
    child.wait(10)
    child.stdout.close()


if __name__ == "__main__":
    main()
