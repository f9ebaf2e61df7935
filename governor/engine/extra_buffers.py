"""Whether llama.cpp may place weights in its CPU "extra buffer" types, decided once per engine process.

llama.cpp's CPU backend offers extra buffer types for weights (`llama_model_params.use_extra_bufts`, on by default):
AMX on x86 CPUs with AMX-INT8 (when the build has it compiled in), then CPU_REPACK, which re-lays Q4_0 / Q4_K /
IQ4_NL / Q8_0 weights for faster matrix products (what makes Q4_0 fast on ARM). The AMX path crashes with SIGSEGV at
the first decode of any quantized model (llama.cpp #20824, Ollama #17205), and llama.cpp has no switch for AMX alone.
Its AMX kernels exist only in a build whose compiler targeted AMX (`__AMX_INT8__`, e.g. `-march=native` on such a
CPU); the set-up builds llama-cpp-python with `-mno-amx-*` on x86 (Makefile), which leaves them out and keeps the
repack. So "auto" turns extra buffers off only where both the CPU reports AMX and the loaded library has AMX kernels
(a wheel built elsewhere, or by plain `pip install`), and keeps them everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.ladder import ExtraBuffersMode
from sensors.root import Root, describe

AMX_FLAGS = ("amx_bf16", "amx_int8", "amx_tile")
CPUINFO = "proc/cpuinfo"
# What `llama_print_system_info()` lists for the CPU backend when it was compiled with AMX-INT8 (ggml-cpu.cpp's
# feature list; `ggml_cpu_has_amx_int8()` is a compile-time answer).
LIBRARY_AMX = "AMX_INT8 = 1"


def library_has_amx(system_info: str) -> bool:
    """Whether llama.cpp's own system info (`llama_print_system_info()`) says its CPU backend has AMX kernels."""
    return LIBRARY_AMX in system_info


@dataclass(frozen=True)
class ExtraBuffers:
    mode: ExtraBuffersMode
    enabled: bool  # what `use_extra_bufts` is set to
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "enabled": self.enabled, "reason": self.reason}


def cpu_flags(root: Root) -> frozenset[str]:
    """The x86 `flags` of /proc/cpuinfo (ARM's are called `Features`, and have no AMX); OSError when unreadable.

    Only the first 64 KiB are read (Root.read): every processor block repeats the same flags, the first is enough.
    """
    text = root.read(root.path(CPUINFO)).decode(errors="replace")
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags)


def choose(mode: ExtraBuffersMode, root: Root, *, library_amx: bool | None = None) -> ExtraBuffers:
    """`library_amx`: whether the loaded llama.cpp has AMX kernels (`library_has_amx`); None when not known, taken as
    yes (the safe side: off on an AMX CPU)."""
    if mode == "on":
        return ExtraBuffers(mode, True, "on as configured (extra_buffers = on)")
    if mode == "off":
        return ExtraBuffers(mode, False, "off as configured (extra_buffers = off): no AMX, no weight repacking")
    where = root.shown(CPUINFO)
    try:
        flags = cpu_flags(root)
    except OSError as exc:
        return ExtraBuffers(mode, True, f"auto: {where} unreadable ({describe(exc)}); assuming no AMX, so on")
    amx = [f for f in AMX_FLAGS if f in flags]
    if amx and library_amx is False:
        return ExtraBuffers(
            mode,
            True,
            f"auto: the CPU reports AMX ({', '.join(amx)} in {where}), but this llama.cpp build has no AMX kernels "
            "(built with -mno-amx-*), so the crashing AMX buffer cannot be chosen: on (weights may be repacked)",
        )
    if amx:
        return ExtraBuffers(
            mode,
            False,
            f"auto: the CPU reports AMX ({', '.join(amx)} in {where}) and this llama.cpp build has AMX kernels; "
            "its AMX weight buffer crashes at the first decode of quantized models (llama.cpp #20824), so extra "
            "buffers are off (this also turns off weight repacking: rebuild llama-cpp-python without AMX, as "
            "`make setup` does, to keep it; extra_buffers = on overrides)",
        )
    return ExtraBuffers(mode, True, f"auto: no AMX in {where}, so on (weights may be repacked for speed)")
