"""A randomized fleet of plausible devices: the ones nobody here has seen (issue 27).

`random_device(seed, index)` draws one device from published ranges; the same (seed, index) always gives the same
device, whatever else is drawn (each device has its own generator, `numpy.random.default_rng([seed, index])`), so
a cell of `bench/lab_fleet.py` can be re-run alone: `governor simulate --device fleet:SEED:INDEX`.

Three classes, each drawn with the characters the lab must cover (compute-bound, memory-bound, skin-limited,
big.LITTLE, hot ambient, little free RAM) arising from the ranges rather than picked by hand:

- phone: skin-limited, big.LITTLE (1-4 big cores + 4-7 little), clock not writable (Termux without root), a
  battery, Android's lmkd (the mapped weights count: it kills on pressure, AOSP system/memory/lmkd).
- board: a single-board computer or kiosk (Raspberry Pi, RK3588, Amlogic), die-limited, mains powered, sometimes
  big.LITTLE (RK3588 4+4, RK3399 2+4), clock writable by a root service (mostly).
- laptop: a fanless laptop or mini PC (x86 package zone, ACPI board zone), sometimes hybrid (P + E cores), a battery
  or mains.

The ranges and their sources are in the comments beside each draw. Model tiers come from a catalogue of real GGUF
files' header figures (Llama 3.x, Qwen2.5, Phi-3.5, SmolLM2), chosen so that the largest tier fits the memory the
device leaves, or barely fits, or does not fit at its full context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from governor.lab.device import (
    BatterySpec,
    CpuSpec,
    DeviceSpec,
    EngineSpec,
    MemorySpec,
    PowerSpec,
    SimModelSpec,
    ThermalSpec,
    TripSpec,
    ZoneSpec,
)
from policies.schema import Memory

CLASSES = ("phone", "board", "laptop")
PREFIX = "fleet"  # `fleet:SEED:INDEX` names a fleet device wherever a device file is accepted


@dataclass(frozen=True)
class CatalogueModel:
    """A published GGUF's header figures; weights_mb is the file size (Q4_K_M unless named)."""

    name: str
    weights_mb: float
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int


# Header figures of the published GGUF files (Hugging Face: HuggingFaceTB/SmolLM2-*-Instruct-GGUF, Qwen/Qwen2.5-*-
# Instruct-GGUF, bartowski/Llama-3.2-*-Instruct-GGUF, bartowski/Phi-3.5-mini-instruct-GGUF, bartowski/Meta-Llama-3.1-
# 8B-Instruct-GGUF); the shipped devices use the same figures for the same files.
CATALOGUE: tuple[CatalogueModel, ...] = (
    CatalogueModel("smollm2-135m-q8", 145, 30, 576, 9, 3, 64, 49152),
    CatalogueModel("smollm2-360m-q8", 386, 32, 960, 15, 5, 64, 49152),
    CatalogueModel("qwen2.5-0.5b-q4km", 491, 24, 896, 14, 2, 64, 151936),
    CatalogueModel("llama-3.2-1b-q4km", 770, 16, 2048, 32, 8, 64, 128256),
    CatalogueModel("qwen2.5-1.5b-q4km", 1117, 28, 1536, 12, 2, 128, 151936),
    CatalogueModel("llama-3.2-3b-q4km", 1926, 28, 3072, 24, 8, 128, 128256),
    CatalogueModel("phi-3.5-mini-q4km", 2393, 32, 3072, 32, 32, 96, 32064),
    CatalogueModel("llama-3.1-8b-q4km", 4692, 32, 4096, 32, 8, 128, 128256),
)


class _Draw:
    """Named draws from one device's generator (rounded: the device file reads like a hand-written one)."""

    def __init__(self, seed: int, index: int) -> None:
        self.rng = np.random.default_rng([seed, index])

    def u(self, lo: float, hi: float, digits: int = 2) -> float:
        return round(float(self.rng.uniform(lo, hi)), digits)

    def log(self, lo: float, hi: float, digits: int = 2) -> float:
        """Log-uniform: for figures that span a factor (resistances, capacities, speeds)."""
        return round(float(np.exp(self.rng.uniform(np.log(lo), np.log(hi)))), digits)

    def int(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def pick(self, options: Sequence[float]) -> float:
        return float(options[int(self.rng.integers(len(options)))])

    def label(self, labels: Sequence[str]) -> str:
        return labels[int(self.rng.integers(len(labels)))]


def _steps(d: _Draw, low: float, n: int) -> tuple[float, ...]:
    """A cpufreq table as cooling states: 1.0 down to `low` in n even steps (Pi: 100 MHz steps; phones 10-20)."""
    return tuple(round(1.0 - (1.0 - low) * i / (n - 1), 3) for i in range(n))


def _ladder(d: _Draw, free_mb: float, core_k: float, prefill_ratio: float) -> tuple[SimModelSpec, ...]:
    """One to three tiers, largest first: the largest fits the memory left at its full context, barely fits, or
    does not (`fit` draws how large against it); smaller tiers are the catalogue's next ones down."""
    memory = Memory()
    n_ctx = int(d.pick([2048, 4096, 4096, 8192]))
    fit = d.u(0.55, 1.25)  # largest tier's footprint at its full context / the memory left (over 1: does not fit)

    def footprint_mb(m: CatalogueModel) -> float:
        spec = _model(m, n_ctx, 1.0, 1.0)
        return spec.footprint().total_bytes(n_ctx, "f16", memory) / (1 << 20)

    fitting = [i for i, m in enumerate(CATALOGUE) if footprint_mb(m) <= fit * free_mb]
    top = fitting[-1] if fitting else 0
    extra = min(top, d.int(0, 2))  # smaller tiers, drawn from the catalogue below the largest
    chosen = [top, *sorted((int(i) for i in d.rng.choice(top, size=extra, replace=False)), reverse=True)]
    return tuple(
        _model(CATALOGUE[i], n_ctx, core_k * d.u(0.85, 1.15) / CATALOGUE[i].weights_mb, prefill_ratio) for i in chosen
    )


def _model(m: CatalogueModel, n_ctx: int, thread_tok_s: float, prefill_ratio: float) -> SimModelSpec:
    return SimModelSpec(
        name=m.name,
        weights_mb=m.weights_mb,
        n_layer=m.n_layer,
        n_embd=m.n_embd,
        n_head=m.n_head,
        n_head_kv=m.n_head_kv,
        head_dim=m.head_dim,
        n_vocab=m.n_vocab,
        n_ctx=n_ctx,
        thread_tok_s=round(thread_tok_s, 3),
        prefill_thread_tok_s=round(thread_tok_s * prefill_ratio, 3),
    )


IDLE_HEADROOM_C = 8.0  # a device idles at least this far under its trip: one over it at idle is not chatting


def _ambient(d: _Draw, trip_c: float, idle_rise_c: float) -> tuple[float, float]:
    """The air (15-45 °C: a cool room to a hot car or a sealed kiosk in the sun; a third of the fleet in warm or hot
    air) and a factor on the idle power, so that the limiting zone idles IDLE_HEADROOM_C under its trip: cooler air
    first (down to 10 °C), then a lower idle power."""
    hot = d.chance(0.3)
    ambient = d.u(28.0, 45.0, 1) if hot else d.u(15.0, 28.0, 1)
    room = trip_c - IDLE_HEADROOM_C - idle_rise_c
    if ambient <= room:
        return ambient, 1.0
    ambient = max(10.0, math.floor(room * 10) / 10)
    return ambient, min(1.0, (trip_c - IDLE_HEADROOM_C - ambient) / idle_rise_c)


def _phone(d: _Draw, name: str) -> DeviceSpec:
    # Big.LITTLE: 1+3+4 (Snapdragon 8 Gen 1: prime + 3 big as one cluster here), 2+6 (Helio G99, Dimensity 700),
    # 4+4 (Exynos, older Snapdragons). A55 cores decode at 0.25-0.45 of an A7x core's pace (lower IPC and clock).
    big = d.int(1, 4)
    little = 8 - big
    skin_trip = d.u(40.0, 46.0, 1)  # vendor skin limits sit at 40-45 °C (ANCHORS: Android thermal, skin-therm)
    die_trip = d.u(85.0, 105.0, 0)  # Qualcomm cpu-*-usr passive trips 95 °C; MediaTek mtktscpu 85-105 °C
    # Sustainable power at the skin limit: IPA's 2000 mW for a 4-inch phone, 4500 mW for a 10-inch tablet
    # (power_allocator.rst); the skin's time constant 8-25 min (about 150-250 g of glass, metal and battery).
    sustain_w = d.u(2.0, 4.5)
    r_ca = round((skin_trip - 25.0) / sustain_w, 2)
    tau_case = d.u(480, 1500, 0)
    thermal = ThermalSpec(
        r_die_case_k_per_w=d.u(2.0, 5.0),
        c_die_j_per_k=d.u(3.0, 8.0),
        r_case_ambient_k_per_w=r_ca,
        c_case_j_per_k=round(tau_case / r_ca, 1),
    )
    total = d.pick([3072, 4096, 6144, 8192, 12288]) * 0.94  # /proc/meminfo's MemTotal after carve-outs
    others = total * d.u(0.45, 0.75)  # Android, the launcher and cached apps keep 45-75 % (lmkd lets them stay)
    core_k = d.log(3000, 6500)  # A76-X3 decode: thread_tok_s x weights_mb (the shipped phone: 5000-5400)
    idle_w = d.u(0.6, 1.5)
    ambient, scale = _ambient(d, skin_trip, idle_w * r_ca)
    return DeviceSpec(
        name=name,
        description=f"fleet phone: {big} big + {little} little cores, skin trip {skin_trip} °C, {ambient} °C air",
        ambient_c=ambient,
        thermal=thermal,
        # published per-core power curves: 1-2.5 W for a big core at its top clock
        power=PowerSpec(idle_w=round(idle_w * scale, 2), thread_w=d.u(1.0, 2.5)),
        cpu=CpuSpec(
            cores=8,
            little_cores=little,
            little_speed=d.u(0.25, 0.45),
            little_thread_w=d.u(0.1, 0.3),
            freq_steps=_steps(d, d.u(0.25, 0.4), d.int(8, 16)),
            poll_s=d.pick([0.5, 1.0, 1.0, 2.0]),
            freq_writable=False,  # Termux without root
        ),
        zone=(
            ZoneSpec(
                label=d.label(["cpu-0-0-usr", "cpu-1-0-usr", "mtktscpu", "cpu_thermal"]),
                node="die",
                trip=(
                    TripSpec(type="passive", temp_c=die_trip, hysteresis_c=d.u(2.0, 5.0, 1)),
                    TripSpec(type="critical", temp_c=die_trip + 15),
                ),
            ),
            ZoneSpec(
                label=d.label(["skin-therm", "xo_therm", "quiet_therm", "back_therm", "case_therm"]),
                node="case",
                trip=(TripSpec(type="passive", temp_c=skin_trip, hysteresis_c=d.u(1.0, 3.0, 1)),),
            ),
        ),
        memory=MemorySpec(total_mb=round(total), other_apps_mb=round(others)),
        battery=BatterySpec(
            capacity_wh=d.u(11.0, 20.0, 1),  # 3000-5000 mAh at 3.85 V
            percent=d.u(45.0, 100.0, 0),  # low battery is a loss the user asks for: not drawn here
            plugged=d.chance(0.2),
            charge_w=d.u(5.0, 20.0, 0),
        ),
        engine=EngineSpec(
            bandwidth_gb_s=d.log(8.0, 30.0),  # LPDDR4X-LPDDR5X, half of peak seen by CPU decode
            load_mb_s=d.log(250.0, 1500.0, 0),  # eMMC 5.1 to UFS 4.0
            restart_s=d.u(1.0, 3.0),
            weights_reclaimable=False,  # lmkd kills on pressure and file-cache thrashing
            model=_ladder(d, total - others, core_k, d.u(3.5, 6.0)),
        ),
    )


def _board(d: _Draw, name: str) -> DeviceSpec:
    hetero = d.chance(0.35)  # RK3588 (4 A76 + 4 A55), RK3399 (2 A72 + 4 A53), S922X (4 A73 + 2 A53)
    if hetero:
        big = d.int(2, 4)
        little = d.int(2, 4)
    else:
        big, little = int(d.pick([4, 4, 4, 2, 8])), 0  # Pi 3/4/5, Zero 2 W (4), 2-core boards, 8-core Cortex
    trip = d.pick([70.0, 75.0, 80.0, 80.0, 85.0, 85.0, 90.0, 95.0])  # Pi firmware 80/85, RK3588 85, Amlogic 80-95
    # Die to air: 5-15 K/W (a Pi 5 bare board ≈ 9.3, a Pi 4 in its closed case ≈ 12.6, a heatsinked RK3588 ≈ 5);
    # the board stage holds 75-90 % of it, its time constant 2-10 min (20-100 g of FR4, copper, a heatsink).
    r_total = d.log(5.0, 15.0)
    r_dc = round(r_total * d.u(0.1, 0.25), 2)
    r_ca = round(r_total - r_dc, 2)
    tau_case = d.u(120, 600, 0)
    thermal = ThermalSpec(
        r_die_case_k_per_w=r_dc,
        c_die_j_per_k=d.u(1.0, 5.0),
        r_case_ambient_k_per_w=r_ca,
        c_case_j_per_k=round(tau_case / r_ca, 1),
    )
    total = d.pick([1024, 2048, 4096, 4096, 8192, 16384]) * 0.95
    others = min(total * 0.6, d.u(250.0, 1500.0, 0))  # an OS with a few services up to a kiosk browser
    core_k = d.log(500, 3200)  # A53 to A76 (Pi 4: 600-800, Pi 5: 2700-2900)
    idle_w = d.u(1.5, 4.0)
    ambient, scale = _ambient(d, trip, idle_w * r_total)
    writable = d.chance(0.85)  # a root service writes scaling_max_freq; some vendor kernels lock it
    return DeviceSpec(
        name=name,
        description=f"fleet board: {big}+{little} cores, trip {trip:g} °C, {ambient} °C air",
        ambient_c=ambient,
        thermal=thermal,
        power=PowerSpec(idle_w=round(idle_w * scale, 2), thread_w=d.u(0.5, 1.8)),  # Pi 4: 2.7 W idle, ~0.9 W a core
        cpu=CpuSpec(
            cores=big + little,
            little_cores=little,
            little_speed=d.u(0.3, 0.5),
            little_thread_w=d.u(0.1, 0.3),
            freq_steps=_steps(d, d.u(0.4, 0.65), d.int(6, 14)),
            poll_s=d.pick([0.25, 0.5, 1.0, 2.0]),
            freq_writable=writable,
        ),
        zone=(
            ZoneSpec(
                label=d.label(["cpu-thermal", "soc-thermal", "cpu_thermal", "bigcore0-thermal"]),
                node="die",
                trip=(
                    TripSpec(type="passive", temp_c=trip, hysteresis_c=d.u(2.0, 5.0, 1)),
                    TripSpec(type="critical", temp_c=trip + d.u(15.0, 30.0, 0)),
                ),
            ),
        ),
        memory=MemorySpec(total_mb=round(total), other_apps_mb=round(others)),
        engine=EngineSpec(
            bandwidth_gb_s=d.log(3.0, 18.0),  # Pi 4 4.5, Pi 5 9, RK3588 ~15 seen by decode
            load_mb_s=d.log(20.0, 1200.0, 0),  # a slow microSD card to NVMe
            restart_s=d.u(1.0, 4.0),
            model=_ladder(d, total - others, core_k, d.u(3.5, 6.0)),
        ),
    )


def _laptop(d: _Draw, name: str) -> DeviceSpec:
    hybrid = d.chance(0.3)  # Intel 12th gen+: 2 P + 4-8 E cores; E cores ~0.55-0.7 of a P core
    big = d.int(2, 4) if hybrid else int(d.pick([2, 4, 4, 6, 8]))
    little = d.int(2, 8) if hybrid else 0
    trip = d.u(85.0, 105.0, 0)  # x86_pkg_temp passive trips (TjMax 100-105; vendors set _PSV at 85-95)
    # Fanless laptops and mini PCs sustain 8-20 W: 3-8 K/W die to air; the chassis holds 40-60 %, 8-25 min.
    r_total = d.log(3.0, 8.0)
    r_dc = round(r_total * d.u(0.35, 0.6), 2)
    r_ca = round(r_total - r_dc, 2)
    tau_case = d.u(480, 1500, 0)
    thermal = ThermalSpec(
        r_die_case_k_per_w=r_dc,
        c_die_j_per_k=d.u(5.0, 20.0),
        r_case_ambient_k_per_w=r_ca,
        c_case_j_per_k=round(tau_case / r_ca, 1),
    )
    total = d.pick([4096, 8192, 8192, 16384, 16384]) * 0.97
    others = total * d.u(0.15, 0.5)  # a headless box to a desktop session with a browser
    core_k = d.log(5000, 12500)  # N100 E-core ≈ 6100, a U-class P core ≈ 11500
    idle_w = d.u(2.0, 6.0)
    ambient, scale = _ambient(d, trip, idle_w * r_total)
    battery = None
    if d.chance(0.6):
        battery = BatterySpec(
            capacity_wh=d.u(30.0, 70.0, 0),
            percent=d.u(45.0, 100.0, 0),
            plugged=d.chance(0.5),
            charge_w=d.u(20.0, 60.0, 0),
        )
    return DeviceSpec(
        name=name,
        description=f"fleet laptop: {big}+{little} cores, trip {trip:g} °C, {ambient} °C air",
        ambient_c=ambient,
        thermal=thermal,
        power=PowerSpec(idle_w=round(idle_w * scale, 2), thread_w=d.u(2.0, 6.0)),  # U-class: 4-6 W a core at turbo
        cpu=CpuSpec(
            cores=big + little,
            little_cores=little,
            little_speed=d.u(0.55, 0.7),
            little_thread_w=d.u(0.8, 1.5),
            freq_steps=_steps(d, d.u(0.35, 0.5), d.int(8, 14)),
            poll_s=d.pick([0.5, 1.0, 2.0]),
            freq_writable=d.chance(0.9),
            hw_limit_c=min(max(trip + 3.0, 100.0), trip + 8.0),  # TjMax: TCC holds it under the critical trip
        ),
        zone=(
            ZoneSpec(
                label="x86_pkg_temp",
                node="die",
                trip=(
                    TripSpec(type="passive", temp_c=trip, hysteresis_c=d.u(2.0, 5.0, 1)),
                    TripSpec(type="critical", temp_c=trip + 10),
                ),
            ),
            ZoneSpec(label="acpitz", node="case"),
        ),
        memory=MemorySpec(total_mb=round(total), other_apps_mb=round(others)),
        battery=battery,
        engine=EngineSpec(
            bandwidth_gb_s=d.log(10.0, 50.0),  # one DDR4 channel to dual-channel LPDDR5
            load_mb_s=d.log(400.0, 3000.0, 0),  # SATA to NVMe
            restart_s=d.u(1.0, 3.0),
            model=_ladder(d, total - others, core_k, d.u(4.5, 7.0)),
        ),
    )


_MAKERS = {"phone": _phone, "board": _board, "laptop": _laptop}


def random_device(seed: int, index: int, cls: str | None = None) -> DeviceSpec:
    """Device `index` of fleet `seed` (its class drawn too unless `cls` names one)."""
    d = _Draw(seed, index)
    drawn = CLASSES[d.int(0, len(CLASSES) - 1)]
    kind = cls or drawn
    if kind not in _MAKERS:
        raise ValueError(f"unknown device class {kind!r}; classes: {', '.join(CLASSES)}")
    return _MAKERS[kind](d, f"{PREFIX}:{seed}:{index}" + (f":{cls}" if cls else ""))


def fleet(seed: int, n: int, cls: str | None = None) -> list[DeviceSpec]:
    return [random_device(seed, i, cls) for i in range(n)]


def parse_name(name: str) -> DeviceSpec | None:
    """`fleet:SEED:INDEX[:CLASS]` -> that device; None when `name` is not a fleet name."""
    if not name.startswith(PREFIX + ":"):
        return None
    parts = name.split(":")
    try:
        seed, index = int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        raise ValueError(f"{name}: expected fleet:SEED:INDEX[:CLASS]") from None
    cls = parts[3] if len(parts) > 3 else None
    return random_device(seed, index, cls)
