"""The layers point one way: govbase <- sensors <- policies <- governor (engine, lab <- daemon).

Every `import` and `from ... import` in the source is read with `ast` (including imports inside functions), so a lazy
import that points the wrong way fails here as well as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("govbase", "sensors", "policies", "governor")

# package prefix -> the packages of ours it must not import (prefix match on the dotted module name)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "govbase": ("sensors", "policies", "governor"),
    "sensors": ("policies", "governor"),
    "policies": ("governor",),
    "governor.engine": ("governor.daemon", "governor.lab"),
    "governor.lab": ("governor.daemon",),
}


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
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
    return found


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


@pytest.mark.parametrize(
    ("file", "source"),
    [
        ("sensors/bad.py", "from governor.daemon import app\n"),
        ("policies/bad.py", "def f():\n    import governor.lab.world\n"),
        ("governor/engine/bad.py", "from ..daemon import proxy\n"),
        ("governor/lab/bad.py", "from governor.daemon.supervisor import x\n"),
        ("govbase/bad.py", "import sensors.root\n"),
    ],
)
def test_the_checker_catches_each_kind(tmp_path: Path, file: str, source: str) -> None:
    for package in OURS:
        (tmp_path / package).mkdir()
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text(source)
    (tmp_path / "governor/daemon").mkdir(exist_ok=True)
    (tmp_path / "governor/daemon/ok.py").write_text("from governor.lab import world\nimport policies\n")
    assert [v.split(": ", 1)[0] for v in violations(tmp_path)] == [f"{file}:{source.count(chr(10))}"]
