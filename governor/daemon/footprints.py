"""Each tier's memory footprint, read from its GGUF header in a short-lived child process.

llama.cpp reads the header (`vocab_only`, governor.engine.header): about 0.5 s for SmolLM2's 49k-token vocabulary
where the `gguf` package's reader took 2-5 s of CPU per tier. It is native code, and its libraries and the header
reader's memory would stay in a daemon living for months: a child runs it and gives it all back.
`python -m governor.daemon.footprints LADDER` prints `{"tier": {field: value}}`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from govbase.errors import GovernorError
from governor.engine.header import read_header
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


def footprint(path: Path) -> ModelFootprint:
    """One tier's footprint from llama.cpp's reading of the header. llama.cpp's metadata leaves out array values, so
    a head count given per layer (where the fit needs the largest) is absent: such a file, and one llama.cpp
    refuses (whose reason then comes as one line), is read with the `gguf` package."""
    header = read_header(path)
    arch = None if header is None else header.meta["general.architecture"]
    heads = (f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv")
    if header is None or not all(key in header.meta for key in heads):
        return ModelFootprint.from_gguf(path)
    return ModelFootprint.from_fields(path, header.meta.get, n_vocab=header.n_vocab)


def _main() -> int:
    try:
        footprints = {tier.name: footprint(tier.path) for tier in load_ladder(Path(sys.argv[1])).tiers}
    except GovernorError as exc:
        print(exc, file=sys.stderr)
        return 2
    json.dump({name: dataclasses.asdict(fp) for name, fp in footprints.items()}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
