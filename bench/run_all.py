"""`make bench`: run every bench/bench_*.py in turn; each prints its own figures and ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    failed = 0
    for script in sorted(Path(__file__).parent.glob("bench_*.py")):
        print(f"\n=== {script.name} ===", flush=True)
        failed += subprocess.call([sys.executable, str(script), *sys.argv[1:]]) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
