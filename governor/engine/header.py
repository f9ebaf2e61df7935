"""A GGUF file's header as llama.cpp reads it, without its weights (`vocab_only`): fast, in C, without the GIL.

The `gguf` package's GGUFReader builds a numpy view per vocabulary entry and merge: 2-5 s of CPU for SmolLM2's 49k
tokens, where llama.cpp takes about 0.5 s. Native code: called in a child process or off the event loop only.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

# The arch's keys read, as llama.cpp prints them (its metadata leaves out arrays: a per-layer value is absent). Not
# llama_model_n_head() and friends: with vocab_only llama.cpp leaves its hparams empty and they abort.
META_KEYS = ("embedding_length", "attention.head_count", "attention.head_count_kv", "attention.key_length",
             "attention.value_length", "block_count")  # fmt: skip


@dataclass(frozen=True)
class Header:
    meta: dict[str, str]  # general.architecture and the arch's META_KEYS present in the file
    n_vocab: int


def read_header(path: Path) -> Header | None:
    """None when llama.cpp cannot read the file (its reason went to its log)."""
    import llama_cpp

    # Without this llama.cpp logs the whole header to stderr; Llama(verbose=False) sets the same level.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return None
    try:
        buf = ctypes.create_string_buffer(256)

        def get(key: str) -> str | None:
            n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
            return buf.value.decode(errors="replace") if 0 <= n < len(buf) else None

        arch = get("general.architecture")
        if arch is None:
            return None
        found = {f"{arch}.{k}": get(f"{arch}.{k}") for k in META_KEYS}
        return Header(
            meta={"general.architecture": arch} | {k: v for k, v in found.items() if v is not None},
            n_vocab=llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)),
        )
    finally:
        llama_cpp.llama_model_free(model)
