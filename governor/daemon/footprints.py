"""Each tier's memory footprint, read from its GGUF header in a short-lived child process.

The `gguf` package pulls in numpy and costs about 16 MB of RSS that a daemon living for months would keep for
nothing after reading three headers; a child gives it all back. `python -m governor.daemon.footprints LADDER`
prints `{"tier": {field: value}}`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from govbase.errors import GovernorError
from policies.assemble import load_footprints
from policies.ladder import load_ladder
from policies.memfit import ModelFootprint

TIMEOUT_S = 120.0


def read_footprints(ladder: Path) -> dict[str, ModelFootprint]:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "governor.daemon.footprints", str(ladder)],
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
    try:
        footprints = load_footprints(load_ladder(Path(sys.argv[1])))
    except GovernorError as exc:
        print(exc, file=sys.stderr)
        return 2
    json.dump({name: dataclasses.asdict(fp) for name, fp in footprints.items()}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
