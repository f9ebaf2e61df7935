"""Whether llama.cpp may place weights in its CPU "extra buffer" types, decided once per engine process.

llama.cpp's CPU backend offers extra buffer types for weights (`llama_model_params.use_extra_bufts`, on by default):
AMX on x86 CPUs with AMX-INT8 (when the build has it compiled in), then CPU_REPACK, which re-lays Q4_0 / Q4_K /
IQ4_NL / Q8_0 weights for faster matrix products (what makes Q4_0 fast on ARM). The AMX path crashes with SIGSEGV at
the first decode of any quantized model (llama.cpp #20824, Ollama #17205), and llama.cpp has no switch for AMX alone,
so "auto" turns extra buffers off only where the CPU reports AMX, and keeps them everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.ladder import ExtraBuffersMode
from sensors.root import Root, describe

AMX_FLAGS = ("amx_bf16", "amx_int8", "amx_tile")
CPUINFO = "proc/cpuinfo"


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


def choose(mode: ExtraBuffersMode, root: Root) -> ExtraBuffers:
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
    if amx:
        return ExtraBuffers(
            mode,
            False,
            f"auto: the CPU reports AMX ({', '.join(amx)} in {where}); llama.cpp's AMX weight buffer crashes at "
            "the first decode of quantized models (llama.cpp #20824), so extra buffers are off (this also "
            "turns off weight repacking; extra_buffers = on overrides)",
        )
    return ExtraBuffers(mode, True, f"auto: no AMX in {where}, so on (weights may be repacked for speed)")
