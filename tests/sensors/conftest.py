from __future__ import annotations

from pathlib import Path

import pytest

from tests.sensors.tree import FakeTree


@pytest.fixture
def tree(tmp_path: Path) -> FakeTree:
    return FakeTree(tmp_path / "root")
