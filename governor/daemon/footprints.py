"""Each tier's memory footprint, read from its GGUF header in a short-lived child process.

The `gguf` package pulls in numpy and costs about 16 MB of RSS that a daemon living for months would keep for
nothing after reading three headers; a child gives it all back. `python -m governor.daemon.footprints` reads
`{"tier": "path"}` JSON on stdin and prints `{"tier": {field: value}}`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from governor.errors import GovernorError
from policies.ladder import ModelLadder
from policies.memfit import ModelFootprint

TIMEOUT_S = 120.0


def read_footprints(ladder: ModelLadder) -> dict[str, ModelFootprint]:
    paths = {tier.name: str(tier.path) for tier in ladder.tiers}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "governor.daemon.footprints"],
            input=json.dumps(paths),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise GovernorError(f"reading the model headers took over {TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise GovernorError(lines[-1] if lines else f"reading the model headers failed ({done.returncode})")
    return {name: ModelFootprint(**fields) for name, fields in json.loads(done.stdout).items()}


def _main() -> int:
    paths: dict[str, str] = json.load(sys.stdin)
    try:
        out = {name: dataclasses.asdict(ModelFootprint.from_gguf(Path(p))) for name, p in paths.items()}
    except GovernorError as exc:
        print(exc, file=sys.stderr)
        return 2
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
