"""The quantized-KV precheck agrees with llama.cpp: refused exactly where llama.cpp would fail to build a context."""

from __future__ import annotations

import string
from pathlib import Path

import gguf
import numpy as np
import pytest

from governor.engine.config import GGML_TYPE, ConfigRefused, ModelSpec, check_kv, head_dim, head_dim_from_metadata
from tests.native import in_child


def tiny_llama(path: Path, *, n_embd: int, n_head: int) -> Path:
    """A one-layer random llama GGUF with head_dim n_embd / n_head (the demo models all have 32)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(256)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *string.ascii_lowercase]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * 26)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    rand("token_embd.weight", len(tokens), n_embd)
    rand("output.weight", len(tokens), n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        rand(f"blk.0.{name}.weight", n_embd, n_embd)
    rand("blk.0.ffn_gate.weight", 256, n_embd)
    rand("blk.0.ffn_up.weight", 256, n_embd)
    rand("blk.0.ffn_down.weight", n_embd, 256)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def builds(path: Path, kv: str, *, flash_attn: bool) -> bool:
    from governor.engine.model import open_llama

    try:
        llm = open_llama(
            path, n_ctx=128, verbose=False, type_k=GGML_TYPE[kv], type_v=GGML_TYPE[kv], flash_attn=flash_attn
        )
    except ValueError:
        return False
    llm.close()
    return True


def precheck_matches_llama_cpp(path: Path, n_embd: int, n_head: int, kv: str, flash_attn: bool) -> None:
    """In the child: head_dim() reads the file with llama.cpp (vocab_only), and llama.cpp builds the context or not."""
    assert head_dim(path) == n_embd // n_head
    spec = ModelSpec("m", path, None, 128, "f16", flash_attn)
    if builds(path, kv, flash_attn=flash_attn):
        check_kv(spec, kv)  # llama.cpp builds it: not refused
    else:
        with pytest.raises(ConfigRefused, match="kv_type") as refused:
            check_kv(spec, kv)
        assert (refused.value.param, refused.value.status) == ("kv_type", 400)


@pytest.mark.parametrize(("n_embd", "n_head"), [(128, 4), (160, 4)])
@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("flash_attn", [True, False])
def test_precheck_matches_llama_cpp(tmp_path: Path, n_embd: int, n_head: int, kv: str, flash_attn: bool) -> None:
    path = tiny_llama(tmp_path / "m.gguf", n_embd=n_embd, n_head=n_head)
    in_child(precheck_matches_llama_cpp, path, n_embd, n_head, kv, flash_attn)


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        ({"general.architecture": "llama", "llama.embedding_length": "576", "llama.attention.head_count": "9"}, 64),
        ({"general.architecture": "qwen2", "qwen2.attention.key_length": "128", "qwen2.embedding_length": "896"}, 128),
        # llama.cpp gives a per-layer array as its type, not its values: unknown, so a quantized KV is refused.
        (
            {
                "general.architecture": "llama",
                "llama.embedding_length": "576",
                "llama.attention.head_count": "arr[i32,30]",
            },
            None,
        ),
        ({"llama.embedding_length": "576"}, None),
    ],
)
def test_head_dim_from_llama_cpp_metadata(meta: dict[str, str], expected: int | None) -> None:
    assert head_dim_from_metadata(meta) == expected
