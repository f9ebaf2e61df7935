"""psutil: the engine process's footprint, and the fallback backend where there is no sysfs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from sensors.psutil_backend import CpuUtilisation, ProcessReading, ProcessStats, PsutilSampler
from sensors.sampler import SensorSampler, make_sampler
from sensors.snapshot import Battery, Cpu, Temperature, Trip
from tests.helpers import eventually


@pytest.fixture
def busy_child() -> Iterator[subprocess.Popen[bytes]]:
    code = "import sys\nb = bytearray(96 * 2**20)\nprint('ready', flush=True)\nwhile True: pass"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None
    assert child.stdout.readline() == b"ready\n"
    yield child
    child.kill()
    child.wait()
    child.stdout.close()


def test_process_stats_of_a_real_process(busy_child: subprocess.Popen[bytes]) -> None:
    stats = ProcessStats(busy_child.pid)

    def busy() -> ProcessReading:
        reading = stats.sample()
        assert reading.cpu_percent
        return reading

    reading = eventually(busy)
    assert reading.rss_bytes is not None
    assert reading.rss_bytes > 96 * 2**20
    assert reading.cpu_percent is not None
    assert reading.cpu_percent > 0
    busy_child.kill()
    busy_child.wait()
    assert stats.sample() == ProcessReading(None, None)  # gone: unknown, not an exception


def test_process_stats_of_no_such_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert ProcessStats(child.pid).sample() == ProcessReading(None, None)


def test_psutil_backend_on_this_machine() -> None:
    snapshot = PsutilSampler().sample()
    assert snapshot.memory.total_bytes == psutil.virtual_memory().total
    assert snapshot.memory.available_bytes is not None
    assert snapshot.cpu.count == psutil.cpu_count()
    # Here psutil sees no sensors and no battery: the snapshot says unknown rather than inventing readings.
    assert len(snapshot.temperatures) == sum(len(v) for v in psutil.sensors_temperatures().values())
    assert (snapshot.battery is None) == (psutil.sensors_battery() is None)


class Shwtemp(NamedTuple):
    label: str
    current: float | None
    high: float | None
    critical: float | None


class Sbattery(NamedTuple):
    percent: float
    secsleft: int
    power_plugged: bool | None


class Scpufreq(NamedTuple):
    current: float
    min: float
    max: float


class Svmem(NamedTuple):
    total: int
    available: int


class Sswap(NamedTuple):
    total: int
    free: int


class FakeMac:
    """The psutil functions a macOS laptop offers (sensors_temperatures is Linux/FreeBSD-only, so a fake adds it)."""

    def sensors_temperatures(self) -> dict[str, list[Shwtemp]]:
        return {
            "coretemp": [Shwtemp("Package id 0", 61.0, 84.0, 100.0), Shwtemp("", 999.0, None, None)],
            "acpitz": [Shwtemp("", 48.0, None, None)],
        }

    def sensors_battery(self) -> Sbattery:
        return Sbattery(64.0, 3600, True)

    def virtual_memory(self) -> Svmem:
        return Svmem(16 * 2**30, 9 * 2**30)

    def swap_memory(self) -> Sswap:
        return Sswap(2**30, 2**29)

    def cpu_freq(self) -> Scpufreq:
        return Scpufreq(1800.0, 800.0, 3600.0)

    def cpu_count(self) -> int:
        return 8


def test_psutil_backend_converts_what_psutil_reports() -> None:
    snapshot = PsutilSampler(FakeMac()).sample()
    assert snapshot.temperatures == (
        Temperature(source="psutil:acpitz/0", kind="psutil", label="acpitz", temp_c=48.0),
        Temperature(
            source="psutil:coretemp/0",
            kind="psutil",
            label="coretemp/Package id 0",
            temp_c=61.0,
            trips=(Trip(type="max", temp_c=84.0), Trip(type="crit", temp_c=100.0)),
        ),
        Temperature(source="psutil:coretemp/1", kind="psutil", label="coretemp", temp_c=None),
    )
    assert [(p.path, p.reason) for p in snapshot.problems] == [("psutil:coretemp/1", "absurd: 999 °C")]
    assert snapshot.battery == Battery(
        percent=64.0, charging=True, plugged=True, power_w=None, temp_c=None, source="psutil"
    )
    assert snapshot.cpu == Cpu(freq_ratio=0.5, throttled=None, count=8, util_percent=None)
    assert snapshot.memory.available_bytes == 9 * 2**30


def test_factory_uses_sysfs_for_a_tree_and_live_util_only_for_the_live_root(tmp_path: Path) -> None:
    sampler = make_sampler(tmp_path, environ={})
    assert isinstance(sampler, SensorSampler)
    assert sampler.sample().cpu.util_percent is None  # psutil's figure would describe this machine, not the tree
    live = make_sampler("/", environ={})
    assert isinstance(live, SensorSampler)  # this Linux machine has /sys/class
    live.close()


def test_cpu_utilisation_is_unknown_until_an_interval_has_passed() -> None:
    now = [0.0]
    util = CpuUtilisation(min_interval_s=0.5, monotonic=lambda: now[0])
    assert util() is None  # the CLI's one-shot sample: too short an interval to mean anything
    now[0] = 0.1
    assert util() is None

    def figure() -> tuple[float]:
        now[0] += 1.0
        value = util()
        assert value is not None  # None only while no clock tick has passed in /proc/stat
        return (value,)

    (value,) = eventually(figure)
    assert 0.0 <= value <= 100.0
    assert util() == value  # within the interval the previous figure stands
