"""Builds fake /sys and /proc trees in the kernel's exact formats (one value and a newline per attribute file)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

THERMAL = "sys/class/thermal"
HWMON = "sys/class/hwmon"
POWER = "sys/class/power_supply"
CPU = "sys/devices/system/cpu"

MEMINFO = """\
MemTotal:        {total} kB
MemFree:          812340 kB
MemAvailable:    {available} kB
Buffers:           52340 kB
Cached:          1203344 kB
SwapCached:            0 kB
SwapTotal:       {swap_total} kB
SwapFree:        {swap_free} kB
Dirty:               132 kB
"""


class FakeTree:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, rel: str) -> Path:
        return self.root / rel

    def write(self, rel: str, value: str | int, *, newline: bool = True) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n" if newline else str(value))
        return path

    def device(self, class_rel: str, device_rel: str) -> str:
        """Like the kernel: sys/class/<class>/<name> is a relative symlink into sys/devices/."""
        link = self.root / class_rel
        if not link.is_symlink():
            (self.root / device_rel).mkdir(parents=True, exist_ok=True)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(self.root / device_rel, link.parent))
        return class_rel

    def remove(self, class_rel: str) -> None:
        """A device going away: its sys/devices directory and its class link both disappear."""
        link = self.root / class_rel
        shutil.rmtree(link.resolve())
        link.unlink()

    def thermal_zone(
        self,
        n: int,
        zone_type: str = "cpu-thermal",
        temp: str | int = 45000,
        trips: tuple[tuple[str, str | int], ...] = (("passive", 85000), ("critical", 105000)),
    ) -> str:
        zone = self.device(f"{THERMAL}/thermal_zone{n}", f"sys/devices/virtual/thermal/thermal_zone{n}")
        self.write(f"{zone}/type", zone_type)
        self.write(f"{zone}/temp", temp)
        self.write(f"{zone}/mode", "enabled")
        self.write(f"{zone}/policy", "step_wise")
        for i, (trip_type, trip_temp) in enumerate(trips):
            self.write(f"{zone}/trip_point_{i}_type", trip_type)
            self.write(f"{zone}/trip_point_{i}_temp", trip_temp)
            self.write(f"{zone}/trip_point_{i}_hyst", 2000)
        return f"{zone}/temp"

    def hwmon(self, n: int, name: str, temps: Mapping[int, Mapping[str, str | int]]) -> str:
        """temps: {1: {"input": 52000, "label": "Core 0", "max": 80000, "crit": 100000}, ...}"""
        chip = self.device(f"{HWMON}/hwmon{n}", f"sys/devices/platform/{name}.{n}/hwmon/hwmon{n}")
        self.write(f"{chip}/name", name)
        for number, attrs in temps.items():
            for attr, value in attrs.items():
                self.write(f"{chip}/temp{number}_{attr}", value)
        return chip

    def supply(self, name: str, **attrs: str | int) -> str:
        self.device(f"{POWER}/{name}", f"sys/devices/platform/{name}-supply/power_supply/{name}")
        for attr, value in attrs.items():
            self.write(f"{POWER}/{name}/{attr}", value)
        self.write(f"{POWER}/{name}/uevent", f"POWER_SUPPLY_NAME={name}")
        return f"{POWER}/{name}"

    def battery(self, name: str = "BAT0", **attrs: str | int) -> str:
        defaults: dict[str, str | int] = {
            "type": "Battery",
            "present": 1,
            "status": "Discharging",
            "capacity": 87,
            "power_now": 5_200_000,
            "energy_now": 43_500_000,
            "energy_full": 50_000_000,
            "voltage_now": 12_100_000,
        }
        return self.supply(name, **{**defaults, **attrs})

    def mains(self, name: str = "AC", online: int = 1) -> str:
        return self.supply(name, type="Mains", online=online)

    def cpu(
        self, n: int, cur_khz: int = 1_500_000, max_khz: int = 2_400_000, scaling_max_khz: int | None = None
    ) -> str:
        freq = f"{CPU}/cpu{n}/cpufreq"
        self.write(f"{freq}/scaling_cur_freq", cur_khz)
        self.write(f"{freq}/cpuinfo_max_freq", max_khz)
        self.write(f"{freq}/cpuinfo_min_freq", 600_000)
        self.write(f"{freq}/scaling_max_freq", scaling_max_khz or max_khz)
        self.write(f"{freq}/scaling_governor", "schedutil")
        return freq

    def cluster(
        self,
        policy: int,
        cpus: range,
        *,
        max_khz: int = 2_400_000,
        min_khz: int = 600_000,
        available: tuple[int, ...] | None = None,
        scaling_max_khz: int | None = None,
        capacity: int | None = None,
    ) -> str:
        """A cpufreq policy (one clock for `cpus`), as the kernel lays it out: cpuN/cpufreq links to cpufreq/policyP;
        `capacity`: each CPU's cpu_capacity (arm64)."""
        rel = f"{CPU}/cpufreq/policy{policy}"
        attrs: dict[str, str | int] = {
            "cpuinfo_max_freq": max_khz,
            "cpuinfo_min_freq": min_khz,
            "scaling_max_freq": scaling_max_khz or max_khz,
            "scaling_min_freq": min_khz,
            "scaling_cur_freq": max_khz,
            "scaling_governor": "schedutil",
            "related_cpus": " ".join(map(str, cpus)),
            "affected_cpus": " ".join(map(str, cpus)),
        }
        for name, value in attrs.items():
            self.write(f"{rel}/{name}", value)
        if available is not None:
            self.write(f"{rel}/scaling_available_frequencies", " ".join(map(str, available)) + " ")
        for n in cpus:
            link = self.root / f"{CPU}/cpu{n}/cpufreq"
            if link.is_dir() and not link.is_symlink():
                shutil.rmtree(link)  # a per-CPU directory written by cpu(): the policy replaces it
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(f"../cpufreq/policy{policy}")
            if capacity is not None:
                self.write(f"{CPU}/cpu{n}/cpu_capacity", capacity)
        return rel

    def cpus(self, count: int, **kwargs: int) -> None:
        for n in range(count):
            self.cpu(n, **kwargs)
        self.write(f"{CPU}/online", f"0-{count - 1}" if count > 1 else "0")

    def meminfo(
        self, total_kb: int = 8_000_000, available_kb: int = 6_000_000, swap_total_kb: int = 0, swap_free_kb: int = 0
    ) -> str:
        text = MEMINFO.format(total=total_kb, available=available_kb, swap_total=swap_total_kb, swap_free=swap_free_kb)
        return str(self.write("proc/meminfo", text, newline=False))

    def psi(self, some: float = 0.0, full: float = 0.0) -> str:
        text = (
            f"some avg10={some:.2f} avg60=0.00 avg300=0.00 total=1234\n"
            f"full avg10={full:.2f} avg60=0.00 avg300=0.00 total=567\n"
        )
        return str(self.write("proc/pressure/memory", text, newline=False))

    def cpu_psi(self, some: float = 0.0) -> str:
        """The system-wide CPU pressure file: the kernel writes `full` as zeros there (Linux >= 5.13)."""
        text = (
            f"some avg10={some:.2f} avg60=0.00 avg300=0.00 total=98765\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        )
        return str(self.write("proc/pressure/cpu", text, newline=False))

    def proc_stat(self, busy: int, idle: int, cpus: int = 2, running: int = 1) -> str:
        """proc/stat with `busy` and `idle` ticks summed over `cpus` CPUs (split over user/system and idle/iowait)."""
        user, system = busy - busy // 4, busy // 4
        lines = [f"cpu  {user} 0 {system} {idle - 3} 3 0 0 0 0 0"]
        lines += [f"cpu{n} {user // cpus} 0 {system // cpus} {idle // cpus} 0 0 0 0 0 0" for n in range(cpus)]
        lines += ["intr 276242 0 0 0", "ctxt 371401", "btime 1796044947", "processes 10113"]
        lines += [f"procs_running {running}", "procs_blocked 0", "softirq 152308 0 13916 3"]
        return str(self.write("proc/stat", "\n".join(lines) + "\n", newline=False))

    def process(self, pid: int, utime: int, stime: int = 0, comm: str = "python3 (engine)") -> str:
        """proc/PID/stat; `comm` may hold spaces and parentheses, as real ones can."""
        fields = ["S", "1", str(pid), str(pid), "0", "-1", "4194304", "98", "0", "0", "0", str(utime), str(stime)]
        fields += ["0", "0", "20", "0", "3", "0", "23467", "3133440", "381"]
        return str(self.write(f"proc/{pid}/stat", f"{pid} ({comm}) {' '.join(fields)}\n", newline=False))

    def laptop(self) -> FakeTree:
        """A typical machine: two zones, a coretemp chip, one battery and mains, 4 CPUs, meminfo and PSI."""
        self.thermal_zone(0, "x86_pkg_temp", 52000)
        self.thermal_zone(1, "acpitz", 48000, trips=(("critical", 103000),))
        self.hwmon(0, "coretemp", {1: {"input": 53000, "label": "Package id 0", "max": 84000, "crit": 100000}})
        self.battery()
        self.mains(online=0)
        self.cpus(4)
        self.meminfo()
        self.psi(1.5, 0.25)
        return self

    def big(self, zones: int = 16, chips: int = 8, cpus: int = 8) -> FakeTree:
        """The benchmark's tree: 16 zones, 8 hwmon chips of 2 inputs, a battery and mains, 8 CPUs."""
        for n in range(zones):
            self.thermal_zone(n, f"cpu-{n}-usr", 40000 + 500 * n)
        for n in range(chips):
            self.hwmon(n, f"chip{n}", {i: {"input": 45000 + i, "label": f"Core {i}", "crit": 100000} for i in (1, 2)})
        self.battery()
        self.mains()
        self.cpus(cpus)
        self.meminfo()
        self.psi()
        return self
