"""The governor installed without its built-in engine (no llama-cpp-python: a phone whose llama.cpp is Termux's
llama-server): the CLI, the lab and the demo ladder work, and the built-in engine says in one line what is missing.

The venv here is real (`python -m venv`) and has every package of the test venv but llama-cpp-python, linked rather
than installed again (a plain `pip install .` resolves the same set: tests/test_build.py checks that llama-cpp-python
is only the `engine` extra)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from governor.programs import find_program

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bare")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    shared = root / "site-packages"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("llama_cpp", "llama_cpp_python-")):
            (shared / entry.name).symlink_to(entry)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    (Path(purelib) / "governor-test.pth").write_text(f"{shared}\n{REPO}\n")
    return python


def governor(python: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    # llama.cpp's own programs as a user's PATH would hold them (here: the ones `make setup` built)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [str(python), "-m", "governor", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_the_bare_venv_has_no_llama_cpp(bare_python: Path) -> None:
    done = subprocess.run(
        [str(bare_python), "-c", "import llama_cpp"], capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode == 1
    assert "No module named 'llama_cpp'" in done.stderr


def test_the_cli_and_the_lab_run_without_llama_cpp_python(bare_python: Path) -> None:
    assert governor(bare_python, "--help").returncode == 0
    lab = governor(bare_python, "simulate", "--device", "phone", "--policy", "default", "--workload", "long-chat",
                   "--minutes", "2")  # fmt: skip

    assert lab.returncode == 0, lab.stderr
    assert "time to first token" in lab.stdout


def test_the_built_in_engine_says_in_one_line_what_is_missing(bare_python: Path, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")

    done = governor(bare_python, "engine", "--model", str(model), "--socket", str(tmp_path / "e.sock"))

    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert "needs llama-cpp-python" in line
    assert "inference-governor[engine]" in line
    assert "--engine llama-server" in line


@pytest.mark.slow
def test_the_demo_ladder_is_quantized_by_llama_quantize_without_llama_cpp_python(
    bare_python: Path, tmp_path: Path
) -> None:
    find_program("llama-quantize")  # make setup builds it beside llama-server
    done = governor(bare_python, "demo-models", "--dir", str(tmp_path / "demo"), timeout=600)

    assert done.returncode == 0, done.stderr
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "demo").glob("*.gguf")}
    tiers = {f"smollm2-135m-instruct-{q}.gguf" for q in ("q8_0", "q4_1", "q4_0")}
    adapters = {f"smollm2-135m-{task}-lora.gguf" for task in ("french", "json")}  # copied, not quantized
    assert set(sizes) == tiers | adapters
    assert sizes["smollm2-135m-instruct-q8_0.gguf"] > sizes["smollm2-135m-instruct-q4_1.gguf"]
    assert sizes["smollm2-135m-instruct-q4_0.gguf"] < sizes["smollm2-135m-instruct-q4_1.gguf"]
