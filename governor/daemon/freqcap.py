"""The CPU frequency actuator: `scaling_max_freq` per cpufreq policy (cluster), as thermald and cpufreq cooling do;
on Intel also `intel_pstate/max_perf_pct` and each RAPL package's long-term power limit.

Lowering the clock costs decode throughput linearly while power falls as f^2-2.5, so on a compute-bound device a cap
is the efficient actuator; threads and the rate cap remain the only ones where nothing here is writable.

Like tuned's plugins it saves the values it found before its first write, in the state directory, and puts them back
on exit, on SIGTERM (the daemon's phased shutdown) and at the next start after a crash (kill -9 leaves the file).
Every path goes through the sensors' `Root`, so tests write on fake sysfs trees under `--root`.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from governor.daemon.originals import Originals
from policies.decision import Decision
from sensors.root import Reader, Root, describe

CPUFREQ = "sys/devices/system/cpu/cpufreq"
PSTATE = "sys/devices/system/cpu/intel_pstate"
POWERCAP = "sys/class/powercap"
RAPL_FLOOR = 0.25  # never limit a RAPL package below this share of the limit found (a crawling machine helps no one)
ORIGINALS = "freq-originals.json"


@dataclass(slots=True)
class Cluster:
    """One cpufreq policy: the CPUs that share a clock (big and LITTLE are separate policies)."""

    name: str  # "policy4"
    cpus: str  # related_cpus, e.g. "4-7"
    path: str  # .../scaling_max_freq under the root
    min_khz: int  # cpuinfo_min_freq: never written below this
    max_khz: int  # cpuinfo_max_freq
    available_khz: tuple[int, ...]  # scaling_available_frequencies, ascending; empty when the driver has none
    original_khz: int  # what scaling_max_freq held before we wrote
    writable: bool
    cap_khz: int | None = None  # what we last wrote; None = the original is in force
    unit: str = "kHz"  # "%" for intel_pstate's max_perf_pct, "µW" for a RAPL limit (then *_khz are in that unit)
    policy: str = ""  # the policy directory, resolved (the sensors' key for it, sensors/cpu.py `Core.policy`)

    def target(self, ratio: float) -> int:
        """The highest frequency the kernel accepts at or under ratio x max, never below min or above the original."""
        want = int(ratio * self.max_khz + 1e-9)
        if self.available_khz:
            under = [f for f in self.available_khz if f <= want]
            want = under[-1] if under else self.available_khz[0]
        return min(self.original_khz, max(self.min_khz, want))


class FreqCap:
    """Writes the decision's frequency ratio to every writable cluster; restores what it found."""

    name = "cpufreq"

    def __init__(self, root: Root, state_dir: Path) -> None:
        self.root = root
        self.originals = Originals(state_dir / ORIGINALS)
        self.clusters: list[Cluster] = []
        self.ratio: float | None = None
        self.reason = "not started"
        self._own: dict[str, int] = {}  # policy directory -> the kHz we wrote there (own_caps)
        self._log = structlog.get_logger("governor.freqcap")

    # -- start: crash recovery, then discovery ------------------------------------------------------------------
    def start(self) -> None:
        self.recover()
        self.clusters = self._discover()
        writable = [c for c in self.clusters if c.writable]
        if not self.clusters:
            self.reason = f"no cpufreq policies under {self.root.shown(CPUFREQ)}: threads and rate are the actuators"
        elif not writable:
            kinds = {c.unit: c.path for c in self.clusters}
            shown = [f"{self.root.shown(CPUFREQ)}/policy*/scaling_max_freq"] if "kHz" in kinds else []
            shown += [self.root.display(kinds[unit]) for unit in ("%", "µW") if unit in kinds]
            why = "not root, or a read-only /sys"
            self.reason = f"{' and '.join(shown)} not writable ({why}): threads and rate are the actuators"
        else:
            names = ", ".join(c.name for c in writable)
            self.reason = f"{len(writable)} of {len(self.clusters)} CPU clock and power limits writable ({names})"
        self._log.debug("cpu frequency actuator", writable=bool(writable), reason=self.reason)

    def recover(self) -> None:
        """A previous run died with caps in force (kill -9, a power cut during a write): put its originals back.

        The file is trusted only when it is ours (governor.daemon.originals), and then only for the limits this
        module writes, as positive integers: run as root, a planted file must not make us write a number into any
        other file."""
        try:
            data = self.originals.load()
            if data is None:
                return
            files = {str(k): int(v) for k, v in data["files"].items()}
            bad = [p for p, v in files.items() if not self._limit_path(p) or not 0 < v < 10**12]
            if bad:
                raise ValueError(f"not a CPU limit this daemon writes: {bad[0]!r} = {files[bad[0]]}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._log.error(
                "cannot use the saved CPU frequency limits; leaving them", file=str(self.originals.path), error=str(exc)
            )
            return
        failed = {path: khz for path, khz in files.items() if not self._write(path, khz)}
        self._log.warning("restored CPU frequency limits left by a previous run", files=len(files) - len(failed))
        if failed:
            return  # keep the file: the next start tries again
        self.originals.clear()

    def _limit_path(self, path: str) -> bool:
        """One of the files `_discover` finds to write, under this root."""
        cpufreq, pstate, powercap = (re.escape(self.root.path(rel)) for rel in (CPUFREQ, PSTATE, POWERCAP))
        return any(
            re.fullmatch(pattern, path)
            for pattern in (
                rf"{cpufreq}/policy\d+/scaling_max_freq",
                rf"{pstate}/max_perf_pct",
                rf"{powercap}/intel-rapl:\d+/constraint_\d_power_limit_uw",
            )
        )

    def _discover(self) -> list[Cluster]:
        reader = Reader(self.root)
        base = self.root.path(CPUFREQ)
        out: list[Cluster] = []
        for name in sorted(reader.listdir(base), key=lambda n: (len(n), n)):
            if not name.startswith("policy"):
                continue
            d = f"{base}/{name}"
            lo, hi, cur = (
                reader.number(f"{d}/{f}") for f in ("cpuinfo_min_freq", "cpuinfo_max_freq", "scaling_max_freq")
            )
            if lo is None or hi is None or cur is None or not 0 < lo <= hi or not 0 < cur <= hi * 1.01:
                continue  # a broken policy is reported by the reader's problems and left alone
            available: list[int] = []
            for word in (reader.optional_text(f"{d}/scaling_available_frequencies") or "").split():
                with contextlib.suppress(ValueError):
                    available.append(int(word))
            path = f"{d}/scaling_max_freq"
            out.append(
                Cluster(
                    name=name,
                    cpus=reader.optional_text(f"{d}/related_cpus") or "",
                    path=path,
                    min_khz=int(lo),
                    max_khz=int(hi),
                    available_khz=tuple(sorted(f for f in available if lo <= f <= hi)),
                    original_khz=int(cur),
                    writable=self.root.writable(path),
                    policy=os.path.realpath(d),
                )
            )
        pstate = self._pstate(reader)
        if pstate is not None:
            out.append(pstate)
        out += self._rapl(reader)
        for problem in reader.problems:
            self._log.warning("cpufreq policy skipped", path=problem.path, reason=problem.reason)
        return out

    def _pstate(self, reader: Reader) -> Cluster | None:
        """Intel's intel_pstate driver: one package-wide limit, `max_perf_pct` (a percentage of the top P-state,
        never below `min_perf_pct`). Written alongside scaling_max_freq (the driver honours both; on some kernels
        and in its passive mode only this one binds)."""
        base = self.root.path(PSTATE)
        texts = [reader.optional_text(f"{base}/{name}") for name in ("max_perf_pct", "min_perf_pct")]
        if texts[0] is None or texts[1] is None:
            return None  # not an Intel CPU, or another driver: absent is normal
        top, low = reader.parse(f"{base}/max_perf_pct", texts[0]), reader.parse(f"{base}/min_perf_pct", texts[1])
        if top is None or low is None or not 0 <= low <= top <= 100:
            return None
        path = f"{base}/max_perf_pct"
        return Cluster(
            name="intel_pstate", cpus="all", path=path, min_khz=max(1, int(low)), max_khz=100,
            available_khz=(), original_khz=int(top), writable=self.root.writable(path), unit="%",
        )  # fmt: skip

    def _rapl(self, reader: Reader) -> list[Cluster]:
        """Intel RAPL: each package's long-term power limit (`intel-rapl:N/constraint_K_power_limit_uw` where
        `constraint_K_name` is `long_term`), the way thermald's RAPL cooling device limits watts. The ratio is taken
        as a share of the limit found (never under RAPL_FLOOR of it, nor the constraint's `min_power_uw`): power
        falls faster than the clock (f^k), so at the same ratio this limit is the looser one and binds where the
        clock limits are not writable; the hot state's PI closes the loop on the temperature either way."""
        base = self.root.path(POWERCAP)
        out: list[Cluster] = []
        for name in sorted(reader.listdir(base)):
            head, _, index = name.partition(":")
            if head != "intel-rapl" or not index.isdigit():
                continue  # subzones (intel-rapl:0:0, core/uncore/dram) and other drivers are left alone
            d = f"{base}/{name}"
            if reader.optional_text(f"{d}/enabled") == "0":
                continue  # a disabled zone does not enforce its limit: writing it would change nothing
            names = [reader.optional_text(f"{d}/constraint_{k}_name") for k in range(3)]
            if "long_term" not in names:
                continue
            k = names.index("long_term")
            path = f"{d}/constraint_{k}_power_limit_uw"
            limit, low = _optional_number(reader, path), _optional_number(reader, f"{d}/constraint_{k}_min_power_uw")
            if limit is None or limit < 1:
                continue
            floor = min(int(limit), max(int(limit * RAPL_FLOOR), int(low or 0), 1))
            zone = Cluster(
                name=name, cpus=reader.optional_text(f"{d}/name") or name, path=path, min_khz=floor,
                max_khz=int(limit), available_khz=(), original_khz=int(limit), writable=self.root.writable(path),
                unit="µW",
            )  # fmt: skip
            out.append(zone)
        return out

    # -- for the policy: the ratios it may choose ---------------------------------------------------------------
    def ratios(self) -> tuple[float, ...] | None:
        """The frequency ratios of the fastest writable cluster (ascending, ending at 1.0); None if nothing writable."""
        writable = [c for c in self.clusters if c.writable]
        if not writable:
            return None
        top = max(writable, key=lambda c: (c.unit == "kHz", c.unit == "%", c.max_khz))  # a clock before watts
        steps = top.available_khz or tuple(range(top.min_khz, top.max_khz, max(1, (top.max_khz - top.min_khz) // 16)))
        return tuple(sorted({round(f / top.max_khz, 4) for f in steps if f >= top.min_khz} | {1.0}))

    # -- the actuator: apply, restore, status ------------------------------------------------------------------
    def apply(self, decision: Decision) -> None:
        """The decision's clock cap (`freq_ratio`)."""
        self.cap(decision.freq_ratio)

    def cap(self, ratio: float | None) -> None:
        """Cap every writable cluster at `ratio` of its own maximum (None or >= 1: the values found at start)."""
        if ratio == self.ratio:
            return
        self.ratio = ratio
        for c in self.clusters:
            if not c.writable:
                continue
            want = None if ratio is None or ratio >= 1.0 else c.target(ratio)
            if want == c.original_khz:
                want = None
            if want == c.cap_khz:
                continue
            if want is not None and not self._save():
                return  # never write a value we could not restore after a crash
            if self._write(c.path, c.original_khz if want is None else want):
                c.cap_khz = want
            else:
                c.writable = False
                self.reason = f"writing {self.root.display(c.path)} failed: threads and rate are the actuators there"
        self._own = self._caps_by_policy()

    def _caps_by_policy(self) -> dict[str, int]:
        return {c.policy: c.cap_khz for c in self.clusters if c.unit == "kHz" and c.cap_khz is not None}

    def own_caps(self) -> dict[str, int]:
        """The clock limit this daemon set on each cpufreq policy, by resolved policy directory: the sensors tell
        the kernel's throttling from it (a step under it), not it from throttling."""
        return self._own

    def restore(self) -> None:
        """Put back every value found at start; then the saved file is no longer needed."""
        ok = True
        for c in self.clusters:
            if c.cap_khz is not None:
                if self._write(c.path, c.original_khz):
                    c.cap_khz = None
                else:
                    ok = False
        self.ratio = None
        self._own = self._caps_by_policy()
        if ok and self.originals.saved:
            self.originals.clear()
            self._log.info("cpu frequency limits restored")

    def _save(self) -> bool:
        """Persist the originals before the first write."""
        if self.originals.saved:
            return True
        try:
            self.originals.save({"files": {c.path: c.original_khz for c in self.clusters if c.writable}})
        except OSError as exc:
            self.reason = f"cannot save the original limits in {self.originals.path}: {exc.strerror}; not capping"
            self._log.error("not capping the CPU frequency", reason=self.reason)
            for c in self.clusters:
                c.writable = False
            return False
        return True

    def _write(self, path: str, khz: int) -> bool:
        try:
            self.root.write(path, f"{khz}\n".encode())
        except OSError as exc:
            self._log.error("cannot write a CPU frequency limit", path=self.root.display(path), error=describe(exc))
            return False
        return True

    # -- for `governor status` ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        writable = any(c.writable for c in self.clusters)
        caps = [c.cap_khz for c in self.clusters if c.cap_khz is not None and c.unit == "kHz"]
        return {
            "writable": writable,
            "reason": self.reason,
            "ratio": self.ratio,
            "freq_cap_khz": max(caps) if caps else None,
            "clusters": [
                {
                    "policy": c.name,
                    "cpus": c.cpus,
                    "writable": c.writable,
                    "cap_khz": c.cap_khz,
                    "original_khz": c.original_khz,
                    "min_khz": c.min_khz,
                    "max_khz": c.max_khz,
                    "unit": c.unit,
                }
                for c in self.clusters
            ],
        }


def _optional_number(reader: Reader, path: str) -> float | None:
    text = reader.optional_text(path)
    return None if text is None else reader.parse(path, text)
