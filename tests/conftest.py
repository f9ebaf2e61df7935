"""Shared fixtures: structlog reset around every test; llama.cpp kept out of the pytest process; the demo models."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from hypothesis import HealthCheck, settings

from governor import logs

# Property tests judge behaviour, never speed: no per-example deadline and no "too slow" health check, which a shared
# CI machine's load would turn into failures (tests/lab/test_thermal.py's property failed once so at load 9).
settings.register_profile("governor", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("governor")

NATIVE = "llama_cpp"
NATIVE_HELP = "native llama.cpp code runs in child processes (tests/native.py in_child, or an engine process)"


def pytest_collection_finish(session: pytest.Session) -> None:
    if NATIVE in sys.modules:
        raise pytest.UsageError(f"collecting the tests imported {NATIVE} into the pytest process; {NATIVE_HELP}")


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    logs.reset()
    yield
    logs.reset()


@pytest.fixture(autouse=True)
def _no_native_code_in_pytest() -> Iterator[None]:
    """A llama.cpp crash (the AMX SIGSEGV of issue 9) must fail one test, not kill the run and its report."""
    before = NATIVE in sys.modules
    yield
    # Only the test that brought it in fails (it stays loaded: a native library cannot be unloaded).
    assert before or NATIVE not in sys.modules, f"this test imported {NATIVE} into the pytest process; {NATIVE_HELP}"


@pytest.fixture
def captured_logs() -> Iterator[list[structlog.typing.EventDict]]:
    with structlog.testing.capture_logs() as entries:
        yield entries


@pytest.fixture(scope="session")
def demo_ladder() -> Path:
    """The demo model ladder TOML (random-weight GGUF models), written once per machine and reused across runs.

    Cached in the repository's `demo-models/` (what `make run` uses) unless GOVERNOR_DEMO_DIR names another directory;
    concurrent test runs are safe (see governor.demo.models).
    """
    directory = Path(os.environ.get("GOVERNOR_DEMO_DIR") or REPO / "demo-models" / "random")
    return _demo_models(directory, "--random")


@pytest.fixture(scope="session")
def real_ladder() -> Path:
    """The real-model ladder (SmolLM2-135M-Instruct tiers), as `make run` writes it into the repository's
    `demo-models/` (GOVERNOR_REAL_DIR names another directory)."""
    return _demo_models(Path(os.environ.get("GOVERNOR_REAL_DIR") or REPO / "demo-models"))


REPO = Path(__file__).resolve().parent.parent


def _demo_models(directory: Path, *flags: str) -> Path:
    # In a child: writing quantizes with llama.cpp.
    cmd = [sys.executable, "-m", "governor", "demo-models", *flags, "--dir", str(directory)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
    return directory / "ladder.toml"
