"""tests/native.py: a native crash in the child fails the one test, naming the signal; the pytest process lives on."""

from __future__ import annotations

import ast
import os
import signal
from pathlib import Path

import pytest

from tests.native import in_child, run_child


def crash(sig: int) -> None:
    os.kill(os.getpid(), sig)


def fail(message: str) -> None:
    raise ValueError(message)


def add(a: int, b: int) -> int:
    return a + b


def test_a_result_comes_back() -> None:
    assert in_child(add, 2, b=3) == 5


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT])
def test_a_crash_fails_the_test_naming_the_signal(sig: signal.Signals) -> None:
    with pytest.raises(pytest.fail.Exception, match=f"crash crashed the child process: killed by {sig.name}"):
        in_child(crash, int(sig))


def test_an_exception_in_the_child_fails_the_test_with_its_traceback() -> None:
    with pytest.raises(
        pytest.fail.Exception, match=r"fail raised in the child process: ValueError: no such thing"
    ) as e:
        in_child(fail, "no such thing")
    assert "Traceback" in str(e.value)


def test_run_child_reports_a_crash_instead_of_failing() -> None:
    out = run_child(crash, int(signal.SIGSEGV))
    assert out.killed is signal.SIGSEGV
    assert (out.kind, out.value) == ("", None)

    out = run_child(add, 2, 3)
    assert (out.killed, out.kind, out.value) == (None, "returned", 5)


# Loads that may bypass the engine's extra-buffers decision, each with why. Everything else must go through
# governor.engine.model.open_llama / LoadedModel without forcing `extra_buffers`.
FORCED_EXTRA_BUFFERS = {
    "tests/governor/engine/test_extra_buffers.py": "compares on with off; 'on' runs only where auto would be on, "
    "and where auto is off it must crash in its child (the AMX path)",
    "bench/bench_extra_buffers.py": "measures what 'off' costs against 'on' (a benchmark run by hand)",
}
LLAMA_CLASSES = {"Llama", "_Llama"}


def native_loads(path: Path) -> list[tuple[int, str]]:
    """Calls in `path` that build a llama.cpp model: `Llama(`/`_Llama(` directly (bypassing open_llama), and
    `open_llama(`/`LoadedModel(` with an explicit `extra_buffers=` that is not None."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in LLAMA_CLASSES:
            found.append((node.lineno, f"{name}(...) bypasses open_llama"))
        forced = any(
            k.arg == "extra_buffers" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
            for k in node.keywords
        )
        if name in {"open_llama", "LoadedModel"} and forced:
            found.append((node.lineno, f"{name}(extra_buffers=...) forces the CPU decision"))
    return found


def test_no_test_or_benchmark_loads_llama_cpp_around_the_engines_cpu_decision() -> None:
    repo = Path(__file__).resolve().parent.parent
    offenders = []
    for path in sorted([*repo.glob("tests/**/*.py"), *repo.glob("bench/**/*.py")]):
        rel = path.relative_to(repo).as_posix()
        for line, what in native_loads(path):
            if not (what.endswith("forces the CPU decision") and rel in FORCED_EXTRA_BUFFERS):
                offenders.append(f"{rel}:{line}: {what}")
    assert not offenders, "load through governor.engine.model.open_llama (tests/native.py):\n" + "\n".join(offenders)


def test_the_check_finds_a_direct_load(tmp_path: Path) -> None:
    sample = tmp_path / "t.py"
    sample.write_text(
        "import llama_cpp\n"
        "llama_cpp.Llama(model_path='m')\n"
        "open_llama('m', extra_buffers=True)\n"
        "open_llama('m', n_ctx=8)\n"
        "LoadedModel(spec, cfg, extra_buffers=None)\n"
    )
    assert native_loads(sample) == [
        (2, "Llama(...) bypasses open_llama"),
        (3, "open_llama(extra_buffers=...) forces the CPU decision"),
    ]
