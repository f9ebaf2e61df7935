"""A test-only fault: `GOVERNOR_ENGINE_FAULT=POINT[@TIER,...]` makes the engine die by SIGSEGV, as a native
llama.cpp crash does (the AMX extra-buffer crash of issue 9 kills the engine at its first decode).

POINT is `load` (after the model loaded, before the socket exists) or `decode` (when a chat request arrives); with
`@TIER,...` only on those tiers, so a test can show the supervisor's step down to a tier that works.
"""

from __future__ import annotations

import os
import resource
import signal
import sys

FAULT_ENV = "GOVERNOR_ENGINE_FAULT"


def maybe_crash(point: str, tier: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    where, _, tiers = spec.partition("@")
    if where != point or (tiers and tier not in tiers.split(",")):
        return
    sys.stderr.write(f"{FAULT_ENV}={spec}: SIGSEGV at {point} of tier {tier}\n")
    sys.stderr.flush()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file for a test's crash
    os.kill(os.getpid(), signal.SIGSEGV)
