"""Memory from `proc/meminfo` (total, available, swap) and `proc/pressure/memory` (PSI some/full avg10)."""

from __future__ import annotations

from sensors.load import read_psi
from sensors.root import Reader, Root
from sensors.snapshot import Memory

MEMINFO = "proc/meminfo"
PSI_MEMORY = "proc/pressure/memory"
# Android's low memory killer daemon (AOSP system/memory/lmkd): it kills on PSI pressure and file-cache thrashing
# before the kernel would, so an engine's mapped weights are not memory the kernel reclaims first there.
LMKD = "system/bin/lmkd"


_MEMINFO_KEYS = ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree")


def read_memory(reader: Reader, root: Root, *, meminfo: bool, psi: bool, lmkd: bool | None = None) -> Memory:
    path = root.path(MEMINFO)
    kb: dict[str, int | None] = dict.fromkeys(_MEMINFO_KEYS)
    text = reader.text(path) if meminfo else None
    if text is not None:
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key not in kb:
                continue
            value = reader.parse(path, rest.strip().partition(" ")[0])  # "16318480 kB"
            if value is not None:
                kb[key] = int(value) * 1024
        for key in ("MemTotal", "MemAvailable"):  # both exist since Linux 3.14
            if kb[key] is None:
                reader.problem(path, f"no {key} line")
    some, full = read_psi(reader, root.path(PSI_MEMORY)) if psi else (None, None)
    return Memory(
        total_bytes=kb["MemTotal"],
        available_bytes=kb["MemAvailable"],
        swap_total_bytes=kb["SwapTotal"],
        swap_free_bytes=kb["SwapFree"],
        psi_some_avg10=some,
        psi_full_avg10=full,
        lmkd=lmkd,
    )
