"""llama.cpp's own programs (`llama-server`, `llama-quantize`): where the governor finds them.

In this order: the path given (a flag or the config file), the PATH (Termux's `pkg install llama-cpp`, a distro
package, a user's own build), then next to this Python (the `.venv/bin` links `make setup` writes to the llama-server
it builds, native/build-llama-server.sh).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from govbase.errors import GovernorError

NO_LLAMA_CPP = (
    "the built-in engine needs llama-cpp-python, which is not installed: pip install 'inference-governor[engine]', "
    "or serve with llama.cpp's own server (governor run --engine llama-server; docs/engines.md)"
)


class ProgramNotFound(GovernorError):
    pass


def find_program(name: str, given: Path | None = None) -> Path:
    """The program's path; ProgramNotFound (one line, saying where it looked) when there is none."""
    if given is not None:
        if given.is_file() and os.access(given, os.X_OK):
            return given
        raise ProgramNotFound(f"{given}: not an executable file (the {name} to run)")
    found = shutil.which(name)
    if found is not None:
        return Path(found)
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    raise ProgramNotFound(
        f"{name} not found on the PATH nor in {beside.parent} (Termux: pkg install llama-cpp; here: make setup "
        f"builds it; or give its path)"
    )
