"""The model ladder file: tiers largest first, paths relative to the file, one-line errors with the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.ladder import LadderError, load_ladder


def test_paths_are_relative_to_the_file_and_order_is_kept(tmp_path: Path) -> None:
    f = tmp_path / "ladder.toml"
    f.write_text('[[tier]]\nname = "big"\npath = "b.gguf"\n\n[[tier]]\nname = "small"\npath = "s.gguf"\nn_ctx = 512\n')
    ladder = load_ladder(f)
    assert [t.name for t in ladder.tiers] == ["big", "small"]
    assert ladder.get("small").path == tmp_path / "s.gguf"
    assert ladder.smaller("big") == ladder.get("small")
    assert ladder.smaller("small") is None


def test_a_typo_names_the_file_the_line_and_the_field(tmp_path: Path) -> None:
    f = tmp_path / "ladder.toml"
    f.write_text('[[tier]]\nname = "big"\npath = "b.gguf"\nkv_typ = "q8_0"\n')
    with pytest.raises(LadderError, match=r"ladder.toml:4: tier.0.kv_typ: Extra inputs are not permitted"):
        load_ladder(f)


def test_duplicate_names_and_bad_toml_are_one_line(tmp_path: Path) -> None:
    f = tmp_path / "ladder.toml"
    f.write_text('[[tier]]\nname = "a"\npath = "a.gguf"\n[[tier]]\nname = "a"\npath = "b.gguf"\n')
    with pytest.raises(LadderError, match="tier names must be unique"):
        load_ladder(f)
    f.write_text("[[tier]\n")
    with pytest.raises(LadderError, match="not valid TOML"):
        load_ladder(f)
    with pytest.raises(LadderError, match="cannot read"):
        load_ladder(tmp_path / "missing.toml")
