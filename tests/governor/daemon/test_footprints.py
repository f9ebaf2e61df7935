"""The daemon reads its tiers' footprints with llama.cpp in a child: the same figures as the `gguf` package's reader."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from govbase.errors import GovernorError
from governor.daemon.footprints import read_footprints
from governor.demo.models import RANDOM_DIR, VOCAB_SIZE, vocabulary, write_demo_models
from policies.assemble import load_footprints
from policies.ladder import load_ladder

REPO = Path(__file__).resolve().parents[3]


def ladder(tmp_path: Path, *paths: Path) -> Path:
    text = "".join(f'[[tier]]\nname = "t{i}"\npath = "{p}"\nn_ctx = 512\n\n' for i, p in enumerate(paths))
    (tmp_path / "ladder.toml").write_text(text)
    return tmp_path / "ladder.toml"


@pytest.mark.slow
def test_the_child_reads_what_the_gguf_package_reads() -> None:
    path = write_demo_models(REPO / RANDOM_DIR)
    assert read_footprints(path) == load_footprints(load_ladder(path))


def header_only(path: Path, kv_heads: int | list[int]) -> Path:
    """A llama header llama.cpp reads (with the demo models' vocabulary) and no tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(3)
    writer.add_embedding_length(256)
    writer.add_head_count(8)
    writer.add_head_count_kv(kv_heads)
    pieces, scores, types = vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
def test_per_layer_arrays_count_their_largest_layer(tmp_path: Path) -> None:
    paths = header_only(tmp_path / "scalar.gguf", 4), header_only(tmp_path / "layers.gguf", [2, 6, 4])
    scalar, layers = read_footprints(ladder(tmp_path, *paths)).values()
    assert (scalar.n_head_kv, scalar.n_layer, scalar.head_dim_k, scalar.n_vocab) == (4, 3, 32, VOCAB_SIZE)
    assert layers.n_head_kv == 6  # not the 8 query heads llama.cpp's metadata would leave as the default


def test_a_file_that_is_not_a_model_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(GovernorError, match=r"bad\.gguf: cannot read GGUF header"):
        read_footprints(ladder(tmp_path, bad))
