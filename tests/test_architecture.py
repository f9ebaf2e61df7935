"""docs/architecture.md stays true: every file, module and class it names exists, every package is in its picture of
the layers, and its recipes touch no more source files than the issue allows (a knob <= 4, an actuator <= 3).
And no source module grows past 400 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs/architecture.md").read_text()
SOURCES = ("govbase/", "sensors/", "policies/", "governor/")
LIMITS = {"Adding a knob": 4, "Adding an actuator": 3}


def _ticked() -> list[str]:
    return re.findall(r"`([^`\n]+)`", DOC)


def _sections() -> dict[str, str]:
    parts = re.split(r"^### ", DOC, flags=re.M)[1:]
    return {part.splitlines()[0].split(" (")[0]: part for part in parts}


def files_of(section: str) -> list[str]:
    """The source files a recipe's `Files:` paragraph names (data files and placeholders' siblings included)."""
    match = re.search(r"^Files: (.*?)(?:\n\n|\Z)", section, flags=re.M | re.S)
    assert match is not None, "a recipe names its files"
    return [p for p in re.findall(r"`([^`]+)`", match.group(1)) if p.startswith(SOURCES)]


def test_every_path_it_names_exists() -> None:
    paths = [t for t in _ticked() if re.fullmatch(r"[\w./*-]+\.(py|toml|md)|[\w-]+/", t)]
    named = [p.split(":")[0] for p in paths if "NAME" not in p and "*" not in p and "/" in p]
    assert named
    assert [p for p in named if not (ROOT / p).exists()] == []


def _module(dotted: str) -> bool:
    """`a.b.c` names a module (not only its package), or an attribute of one (`policies.StateMachine.decide`)."""
    parts = dotted.split(".")
    bases = [ROOT.joinpath(*parts[:n]) for n in range(len(parts), 1, -1)]
    return any(base.with_suffix(".py").exists() or (base / "__init__.py").exists() for base in bases)


def test_every_module_and_class_it_names_exists() -> None:
    text = "\n".join(p.read_text() for d in (*SOURCES, "tests/") for p in (ROOT / d).rglob("*.py"))
    dotted = set(re.findall(r"\b((?:governor|policies|sensors)(?:\.\w+)+)\b(?!\.(?:py|md|toml))", DOC))
    missing = [m for m in dotted if not m.endswith((".py", ".md", ".toml")) and not _module(m)]
    classes = {t for t in _ticked() if re.fullmatch(r"[A-Z][a-z]+(?:[A-Z][a-z]+)+", t)}
    missing += [c for c in classes if not re.search(rf"^class {c}\b|^{c} = ", text, flags=re.M)]
    assert sorted(missing) == []


def test_the_picture_of_the_layers_has_every_package() -> None:
    picture = DOC.split("```")[1]
    packages = [p.name for p in (ROOT / "governor").iterdir() if (p / "__init__.py").exists()]
    assert [p for p in (*packages, "govbase", "sensors", "policies") if f"{p}/" not in picture] == []


@pytest.mark.parametrize(("recipe", "limit"), LIMITS.items())
def test_a_recipe_touches_no_more_source_files_than_allowed(recipe: str, limit: int) -> None:
    files = files_of(_sections()[recipe])
    assert 0 < len(files) <= limit, files


def test_every_recipe_names_its_files() -> None:
    sections = _sections()
    assert {
        "Adding a knob",
        "Adding an actuator",
        "Adding an engine driver",
        "Adding a sensor",
        "Adding a state",
    } <= set(sections)
    assert all(files_of(body) for title, body in sections.items() if title.startswith("Adding"))


MAX_MODULE_LINES = 400  # STYLE.md: a module that grows past about 400 lines is asking to be split


def oversized(root: Path) -> list[str]:
    """Every source module under governor/, policies/ and sensors/ longer than MAX_MODULE_LINES, as 'path: N lines'."""
    modules = sorted(p for d in ("governor", "policies", "sensors") for p in (root / d).rglob("*.py"))
    counts = {p.relative_to(root).as_posix(): len(p.read_text().splitlines()) for p in modules}
    return [f"{path}: {n} lines" for path, n in counts.items() if n > MAX_MODULE_LINES]


def test_no_source_module_is_over_400_lines() -> None:
    assert oversized(ROOT) == []


def test_the_size_check_names_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies/short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "policies/long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(tmp_path) == [f"policies/long.py: {MAX_MODULE_LINES + 1} lines"]
