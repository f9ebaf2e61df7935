"""The layers point one way: govbase <- sensors <- policies <- governor's loop (loop, actuator, clock) <- engine <-
daemon and lab (neither imports the other) <- views and the CLI; the demo models' tooling stands apart. And no modules
import each other in a circle.

Every `import` and `from ... import` in the source is read with `ast` (including imports inside functions and under
TYPE_CHECKING), so a lazy import that points the wrong way, or closes a circle, fails here as well as a top-level one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("govbase", "sensors", "policies", "governor")

# package prefix -> the packages of ours it must not import (prefix match on the dotted module name)
APPS = ("governor.daemon", "governor.lab", "governor.views", "governor.demo", "governor.benchdevice", "governor.cli")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "govbase": ("sensors", "policies", "governor"),
    "sensors": ("policies", "governor"),
    "policies": ("governor",),
    # the loop and what it is built from, shared by the daemon and the lab: below every application of it
    **dict.fromkeys(("governor.loop", "governor.actuator", "governor.clock"), ("governor.engine", *APPS)),
    "governor.engine": ("governor.daemon", "governor.lab", "governor.views", "governor.demo", "governor.benchdevice"),
    "governor.lab": ("governor.daemon", "governor.views", "governor.demo", "governor.benchdevice"),
    "governor.daemon": ("governor.lab", "governor.views", "governor.demo", "governor.benchdevice"),
    "governor.demo": ("governor.engine", "governor.daemon", "governor.lab", "governor.views"),
}


def _imports(path: Path, module: str, *, names: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every import; with `names`, `from a import b` gives `a.b` too (b may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            if names:
                found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def _modules(root: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in OURS:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def circles(root: Path) -> list[list[str]]:
    """Every set of our modules that import each other in a circle (strongly connected, Tarjan), sorted."""
    modules = _modules(root)
    graph = {
        module: sorted({name for _, name in _imports(path, module, names=True) if name in modules and name != module})
        for module, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return sorted(out)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: Path) -> list[str]:
    """Every import under `root`'s packages that points the wrong way, as 'file:line: a imports b'."""
    out: list[str] = []
    for package in OURS:
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            rules = [bad for layer, bad in FORBIDDEN.items() if _within(module, layer)]
            for lineno, name in _imports(path, module):
                if any(_within(name, bad) for banned in rules for bad in banned):
                    out.append(f"{path.relative_to(root)}:{lineno}: {module} imports {name}")
    return out


def test_no_import_points_the_wrong_way() -> None:
    assert violations(ROOT) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circles(ROOT) == []


def test_the_circle_finder_finds_a_lazy_circle_and_not_a_chain(tmp_path: Path) -> None:
    for package in OURS:
        (tmp_path / package).mkdir()
    (tmp_path / "governor/lab").mkdir()
    (tmp_path / "governor/lab/a.py").write_text("from governor.lab.b import x\n")
    (tmp_path / "governor/lab/b.py").write_text("def f():\n    from governor.lab import a\n")
    (tmp_path / "governor/lab/c.py").write_text("from governor.lab import a\n")
    assert circles(tmp_path) == [["governor.lab.a", "governor.lab.b"]]


@pytest.mark.parametrize(
    ("file", "source"),
    [
        ("sensors/bad.py", "from governor.daemon import app\n"),
        ("policies/bad.py", "def f():\n    import governor.lab.world\n"),
        ("governor/engine/bad.py", "from ..daemon import proxy\n"),
        ("governor/lab/bad.py", "from governor.daemon.supervisor import x\n"),
        ("governor/loop.py", "from governor.daemon import app\n"),
        ("governor/daemon/bad.py", "from governor.lab import world\n"),
        ("govbase/bad.py", "import sensors.root\n"),
    ],
)
def test_the_checker_catches_each_kind(tmp_path: Path, file: str, source: str) -> None:
    for package in OURS:
        (tmp_path / package).mkdir()
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text(source)
    (tmp_path / "governor/daemon").mkdir(exist_ok=True)
    (tmp_path / "governor/views").mkdir(exist_ok=True)
    (tmp_path / "governor/views/ok.py").write_text("from governor.lab import world\nimport governor.daemon\n")
    assert [v.split(": ", 1)[0] for v in violations(tmp_path)] == [f"{file}:{source.count(chr(10))}"]


def test_the_reconfiguration_plan_and_the_lab_load_no_native_engine() -> None:
    """What the engine and the lab must agree on is importable without llama.cpp (the lab imports it, never a copy)."""
    code = "import sys, governor.engine.plan, governor.lab.experiment; print([m for m in sys.modules if 'llama' in m])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]"
