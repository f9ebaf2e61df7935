"""The set-up's build of llama.cpp (Makefile): on x86 the compiler may not target AMX, so llama.cpp has no AMX kernels
and keeps its weight repack (docs/engine.md#amx-cpus-and-extra_buffers); and it builds the version pyproject pins."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
AMX_MACROS = {"__AMX_INT8__", "__AMX_TILE__", "__AMX_BF16__"}


def make_variable(target: str) -> str:
    run = subprocess.run(
        ["make", "-s", "--no-print-directory", "-C", str(REPO), target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return run.stdout.strip()


def macros(*flags: str) -> set[str]:
    """The macros the C compiler defines for a Sapphire Rapids target (AMX-INT8, AMX-TILE, AMX-BF16) with `flags`."""
    run = subprocess.run(
        ["cc", "-march=sapphirerapids", *flags, "-dM", "-E", "-x", "c", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return {m[1] for m in re.finditer(r"#define (\S+)", run.stdout)}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX is x86 only: elsewhere llama.cpp builds as it is")
@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("make") is None, reason="no C compiler or make")
def test_the_set_ups_flags_keep_amx_out_of_a_build_for_an_amx_cpu() -> None:
    flags = make_variable("llama-cflags").split()

    assert flags, "the Makefile builds llama.cpp on x86 with no flag against AMX"
    assert macros() >= AMX_MACROS  # what ggml's -march=native gives on such a CPU: its AMX kernels compile
    kept = macros(*flags)
    assert not AMX_MACROS & kept
    assert {"__AVX512VNNI__", "__AVX512F__", "__AVX2__"} <= kept  # the rest of the CPU's ISA stays


def test_the_set_up_builds_the_llama_cpp_python_that_pyproject_pins() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = [d for d in project["optional-dependencies"]["engine"] if d.startswith("llama-cpp-python")]
    made = re.search(r"^LLAMA\s*:=\s*(\S+)", (REPO / "Makefile").read_text(), re.M)

    assert made is not None
    assert pinned == [made[1]]


def test_llama_cpp_python_is_only_the_built_in_engines_extra() -> None:
    """A plain `pip install` (a phone with Termux's llama-server) compiles no llama.cpp; `make setup` installs it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    assert not [d for d in project["dependencies"] if d.startswith("llama-cpp-python")]
    assert "'.[engine,dev]'" in (REPO / "Makefile").read_text()
