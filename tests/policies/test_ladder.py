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


TIER = '[[tier]]\nname = "medium"\npath = "m.gguf"\n'


def test_adapters_are_validated_like_tiers(tmp_path: Path) -> None:
    f = tmp_path / "ladder.toml"
    f.write_text(TIER + '\n[[adapter]]\nname = "french"\npath = "fr.gguf"\nbase = "medium"\nscale = 0.5\n')
    ladder = load_ladder(f)
    (french,) = ladder.adapters
    assert (french.name, french.base, french.scale, french.path) == ("french", "medium", 0.5, tmp_path / "fr.gguf")
    for body, message in [
        ('name = "fr"\npath = "a.gguf"\nbase = "large"', "base 'large' is not a tier of this ladder"),
        ('name = "medium"\npath = "a.gguf"\nbase = "medium"', "adapter 'medium' has a tier's name"),
        ('name = "m:fr"\npath = "a.gguf"\nbase = "medium"', r"adapter.0.name: String should match pattern"),
        ('name = "fr"\npath = "a.gguf"\nbase = "medium"\nscale = 0', r"adapter.0.scale: .*greater than 0"),
        ('name = "fr"\npath = "a.gguf"\nbase = "medium"\nscale = nan', r"adapter.0.scale"),
        ('name = "fr"\npath = "a.gguf"\nbase = "medium"\nscale = 9.0', r"adapter.0.scale: .*less than or equal to 4"),
        ('name = "fr"\npath = "a.gguf"\nbase = "medium"\nrank = 8', r"ladder.toml:\d+: adapter.0.rank: Extra inputs"),
    ]:
        f.write_text(TIER + "\n[[adapter]]\n" + body + "\n")
        with pytest.raises(LadderError, match=message):
            load_ladder(f)
    twice = '\n[[adapter]]\nname = "fr"\npath = "a.gguf"\nbase = "medium"\n'
    f.write_text(TIER + twice + twice)
    with pytest.raises(LadderError, match="adapter names must be unique"):
        load_ladder(f)
