"""One loaded llama.cpp model and context, with the few per-token calls the worker makes on it."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_chat_format import CHATML_CHAT_TEMPLATE, Jinja2ChatFormatter
from llama_cpp.llama_grammar import LlamaGrammar

from governor.engine.adapterspec import AdapterError, AdapterSpec
from governor.engine.binding import Llama, llama_log, malloc_trim, weight_buffers
from governor.engine.config import GGML_TYPE, ModelSpec, head_dim, learn_head_dim
from governor.engine.extra_buffers import ExtraBuffers, choose, library_has_amx
from governor.engine.plan import cache_fits
from governor.engine.window import Cut
from policies.decision import EngineConfig
from policies.ladder import ExtraBuffersMode
from sensors.root import Root


class ModelLoadError(Exception):
    pass


def extra_buffers_for(mode: ExtraBuffersMode = "auto", root: Root | None = None) -> ExtraBuffers:
    """The engine's extra-buffers decision: `mode` against this machine's CPU (`root`'s /proc/cpuinfo) and the
    llama.cpp library loaded in this process (whether it has AMX kernels, from its own system info)."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return choose(mode, root or Root("/"), library_amx=library_has_amx(info))


def open_llama(model_path: str | Path, *, extra_buffers: bool | None = None, **kwargs: Any) -> Llama:
    """Every `Llama` the engine, its tests and its benchmarks build comes from here: `extra_buffers` None takes the
    engine's own "auto" decision (`extra_buffers_for`), so a test's load takes the same CPU path as the engine's."""
    if extra_buffers is None:
        extra_buffers = extra_buffers_for().enabled
    return Llama(model_path=str(model_path), extra_buffers=extra_buffers, **kwargs)


@dataclass(frozen=True)
class SavedSequence:
    tokens: list[int]
    data: Any  # ctypes uint8 array
    size: int
    adapter: str | None = None  # the LoRA adapter whose weights computed it: valid only under the same one


# llama.cpp's reasons an adapter does not fit a model (llama-adapter.cpp), as opposed to a broken file.
_MISFIT = ("arch mismatch", "does not exist in base model", "incorrect shape")


class LoadedModel:
    """Owns a `llama_cpp.Llama`; only the worker thread calls it once the engine runs."""

    def __init__(
        self,
        spec: ModelSpec,
        settings: EngineConfig,
        *,
        on_progress: Callable[[float], None] | None = None,
        extra_buffers: bool | None = None,
    ) -> None:
        """`extra_buffers` None: the engine's "auto" decision for this machine (`open_llama`)."""
        self.spec = spec
        self.n_ctx = settings.n_ctx
        self.kv_type = settings.kv_type
        self.weight_buffers_mib: dict[str, float] = {}  # where llama.cpp put the weights: AMX, CPU_REPACK, CPU...
        try:
            with weight_buffers(self.weight_buffers_mib):
                self.llm = open_llama(
                    spec.path,
                    n_ctx=settings.n_ctx,
                    n_batch=settings.n_batch,  # the compute buffer and the logits buffer grow with these
                    n_ubatch=settings.n_batch,
                    n_threads=settings.threads,
                    n_threads_batch=settings.threads,
                    type_k=GGML_TYPE[settings.kv_type],
                    type_v=GGML_TYPE[settings.kv_type],
                    flash_attn=spec.flash_attn,
                    verbose=False,
                    on_progress=on_progress,
                    extra_buffers=extra_buffers,
                )
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load {spec.path} with {settings.model_dump()}: {exc}") from exc
        self.threads = settings.threads
        meta: dict[str, str] = self.llm.metadata
        learn_head_dim(spec.path, meta)
        template = meta.get("tokenizer.chat_template") or CHATML_CHAT_TEMPLATE
        eos, bos = self.llm.token_eos(), self.llm.token_bos()
        model = self.llm._model
        self._formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            bos_token=model.token_get_text(bos) if bos != -1 else "",
        )
        self.template_stop = self._formatter.eos_token
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._buf = ctypes.create_string_buffer(256)
        self._tokens: dict[int, tuple[bool, bytes]] = {}
        self.cut: Cut | None = None  # the chat's last chunked trim in this context (governor.engine.window)
        self.abort_requested = False
        self._abort_cb = llama_cpp.ggml_abort_callback(self._should_abort)
        self._no_cb = llama_cpp.ggml_abort_callback()
        # LoRA adapters loaded on this model, least recently used first (governor.engine.adapters owns the order),
        # the one set on the context (its weights computed the KV cache), and caches parked by adapter switches.
        self.adapters: OrderedDict[str, Any] = OrderedDict()
        self.adapter: str | None = None
        self.parked: OrderedDict[str | None, SavedSequence] = OrderedDict()

    @property
    def architecture(self) -> str | None:
        arch = self.llm.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    @property
    def label(self) -> str:
        """The model id an answer reports: the tier, and ":ADAPTER" when one is set."""
        return self.spec.name if self.adapter is None else f"{self.spec.name}:{self.adapter}"

    def load_adapter(self, spec: AdapterSpec) -> None:
        """llama_adapter_lora_init: the adapter's matrices into a CPU buffer of this model (AdapterError with
        llama.cpp's reason when it refuses: another architecture, other shapes, a broken file)."""
        lines: list[str] = []
        with llama_log(lambda text: lines.append(text.decode(errors="replace").strip())):
            handle = llama_cpp.llama_adapter_lora_init(self.llm.model, str(spec.path).encode())
        if not handle:
            reason = next((ln.split(": ", 2)[-1] for ln in lines if "lora" in ln.lower() and "fail" in ln), "")
            reason = reason or next((ln for ln in reversed(lines) if ln), "no reason given")
            if any(m in reason for m in _MISFIT):
                raise AdapterError(
                    f"adapter {spec.name!r} does not fit tier {self.spec.name!r} (llama.cpp: {reason})",
                    status=503,
                    code="adapter_unavailable",
                )
            raise AdapterError(
                f"adapter {spec.name!r} cannot be loaded from {spec.path} (llama.cpp: {reason})",
                status=500,
                code="adapter_invalid",
            )
        self.adapters[spec.name] = handle

    def free_adapter(self, name: str) -> None:
        if name == self.adapter:  # never while it computes the cache: the base model takes over, cache cleared
            self.clear_cache()
            self.set_adapter(None, None)
        llama_cpp.llama_adapter_lora_free(self.adapters.pop(name))

    def set_adapter(self, name: str | None, scale: float | None) -> None:
        """The context's adapter from the next decode on (llama.cpp re-reserves its compute graph then)."""
        if name is None:
            llama_cpp.llama_set_adapters_lora(self.llm.ctx, None, 0, None)
        else:
            handles = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self.adapters[name])
            scales = (ctypes.c_float * 1)(1.0 if scale is None else scale)
            llama_cpp.llama_set_adapters_lora(self.llm.ctx, handles, 1, scales)
        self.adapter = name

    def clear_cache(self) -> None:
        """Forget the KV cache (the next evaluation starts from the first token)."""
        self.llm.reset()  # type: ignore[no-untyped-call]
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm.ctx), False)

    def sequence_bytes(self) -> int:
        """What `save_sequence` would copy (0: empty cache)."""
        return int(llama_cpp.llama_state_seq_get_size(self.llm.ctx, 0)) if self.llm.n_tokens else 0

    def _should_abort(self, data: object) -> bool:
        return self.abort_requested

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A long prompt evaluation that `abort()` can stop between graph nodes (llama_decode then fails).

        Only around prefills: llama.cpp calls the callback at every graph node (hundreds per token), which would
        cost a few percent of decode speed if it stayed installed.
        """
        self.abort_requested = False
        llama_cpp.llama_set_abort_callback(self.llm.ctx, self._abort_cb, None)
        try:
            yield
        finally:
            llama_cpp.llama_set_abort_callback(self.llm.ctx, self._no_cb, None)

    @property
    def context_tokens(self) -> int | None:
        """Tokens in the KV cache now: the context's fill, whose KV every decode step reads (None: closing)."""
        llm = getattr(self, "llm", None)  # read from the event loop while the worker may be closing the model
        return None if llm is None else int(llm.n_tokens)

    @property
    def evaluated(self) -> int:
        """Tokens evaluated in this context so far (a counter: differences tell what one step cost)."""
        return self.llm.evaluated

    @functools.cached_property
    def can_shift(self) -> bool:
        """llama.cpp can move cached tokens to other positions: it says so (false for some architectures, e.g.
        M-RoPE), and the cache is not a quantized one with heads smaller than 64. llama.cpp 0.3.36 reports true
        there, but moving a q8_0 K cache of head_dim 32 (the random demo models) crashes it with SIGSEGV at the next
        decode; SmolLM2 (head_dim 64) shifts q8_0 and q4_0 caches fine."""
        if self.kv_type != "f16" and (head_dim(self.spec.path) or 0) < 64:
            return False
        return bool(llama_cpp.llama_memory_can_shift(llama_cpp.llama_get_memory(self.llm.ctx)))

    def reuse(self, tokens: Sequence[int], *, min_run: int = 16) -> int:
        """Context shift: make more of `tokens` a prefix of the cache. Where the cache and `tokens` part (after
        the system message, say), look for the rest of `tokens` further on in the cache; when a run of at least
        `min_run` tokens matches, remove the tokens before it from the cache and
        shift the rest back (llama_memory_seq_rm + llama_memory_seq_add, as llama.cpp server's context shift and
        cache reuse do). `generate()` then evaluates only what follows. Returns how many tokens were removed."""
        llm = self.llm
        n = llm.n_tokens
        cache = llm.input_ids[:n]
        want = np.asarray(tokens, dtype=cache.dtype)
        keep = _common_prefix(cache, want)
        if keep >= len(want) - 1 or keep >= n - 1 or not self.can_shift:
            return 0
        for found in np.flatnonzero(cache[keep + 1 :] == want[keep]):
            shift = int(found) + 1
            if _common_prefix(cache[keep + shift :], want[keep:]) >= min_run:
                break
        else:
            return 0
        mem = llama_cpp.llama_get_memory(llm.ctx)
        if not llama_cpp.llama_memory_seq_rm(mem, 0, keep, keep + shift):
            return 0
        llama_cpp.llama_memory_seq_add(mem, 0, keep + shift, n, -shift)
        cache[keep : n - shift] = cache[keep + shift : n].copy()
        llm.n_tokens = n - shift
        llm._requires_eval = True  # the logits in the context are the old last token's
        return shift

    def abort(self) -> None:
        """From any thread: stop the interruptible prefill under way, if any."""
        self.abort_requested = True

    # chat.Tokenizer
    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return self._formatter(messages=list(messages)).prompt  # type: ignore[arg-type]

    def encode(self, text: str, *, prompt: bool) -> list[int]:
        # As llama_cpp's own chat handlers do: the template writes BOS itself, and its special tokens are parsed.
        return list(self.llm.tokenize(text.encode(), add_bos=False, special=prompt))

    def token(self, token: int) -> tuple[bool, bytes]:
        """(ends generation, its text bytes), cached: each ctypes call is a point where the worker gives up the GIL
        and may wait for the event loop to hand it back, so the per-token path makes as few as it can."""
        known = self._tokens.get(token)
        if known is None:
            n = llama_cpp.llama_token_to_piece(self._vocab, token, self._buf, len(self._buf), 0, False)
            eog = bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))
            known = self._tokens[token] = (eog, self._buf.raw[:n] if n > 0 else b"")
        return known

    def set_live(self, settings: EngineConfig) -> None:
        """Apply the settings llama.cpp changes between two tokens (the knobs' `live` flag; the rate cap is the
        worker's pace, not the model's)."""
        if settings.threads != self.threads:
            self.set_threads(settings.threads)

    def set_threads(self, n: int) -> None:
        # Takes effect at the next decode; assigning `Llama.n_threads` alone would change nothing.
        llama_cpp.llama_set_n_threads(self.llm.ctx, n, n)
        self.llm.n_threads = self.llm.n_threads_batch = n
        self.threads = n

    def encode_plain(self, text: str) -> list[int]:
        """A plain completion's prompt: no template, so BOS is added here (as llama.cpp's server does)."""
        return list(self.llm.tokenize(text.encode(), add_bos=True, special=True))

    def grammar_error(self, grammar: str) -> str | None:
        """None when llama.cpp can build a sampler from `grammar`, else why not (checked before generating: a
        grammar llama.cpp rejects would otherwise be a null sampler in the chain)."""
        sampler = llama_cpp.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not sampler:
            return "llama.cpp could not parse the grammar made from it"
        llama_cpp.llama_sampler_free(sampler)
        return None

    def generate(
        self,
        tokens: Sequence[int],
        sampling: dict[str, Any],
        seed: int | None,
        *,
        grammar: str | None = None,
        replay: Sequence[int] = (),
    ) -> Any:
        """A token generator; `grammar` constrains it, `replay` are tokens of the answer already accepted by it."""
        self.llm.set_seed(seed if seed is not None else llama_cpp.LLAMA_DEFAULT_SEED)
        self.llm.replay = list(replay)
        g = None if grammar is None else LlamaGrammar.from_string(grammar, verbose=False)
        return self.llm.generate(tokens, reset=True, grammar=g, **sampling)

    def warm_up(self) -> None:
        """One decode of one token, then forget it (llama.cpp's server does the same after loading)."""
        bos = self.llm.token_bos()
        self.llm.eval([bos if bos != -1 else self.llm.token_eos()])
        self.llm.reset()  # type: ignore[no-untyped-call]

    def save_sequence(self) -> SavedSequence | None:
        """The cached tokens and their KV-cache state (llama_state_seq_get_data), for a new context of the same
        model and KV type; None when the cache is empty."""
        n = self.llm.n_tokens
        if n == 0:
            return None
        ctx = self.llm.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        got = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
        return SavedSequence(self.llm.input_ids[:n].tolist(), buf, got, self.adapter) if got else None

    def restore_sequence(self, saved: SavedSequence) -> bool:
        """Put a saved sequence into this context's cache (llama_state_seq_set_data); False when it does not fit or
        was computed under another adapter than the one set now (the cache stays empty then)."""
        n = len(saved.tokens)
        if saved.adapter != self.adapter:
            return False
        if not cache_fits(n, self.n_ctx) or not llama_cpp.llama_state_seq_set_data(
            self.llm.ctx, saved.data, saved.size, 0
        ):
            return False
        self.llm.input_ids[:n] = saved.tokens
        self.llm.n_tokens = n
        self.llm._requires_eval = True  # the state holds no logits: generate() evaluates the last token again
        return True

    def close(self) -> None:
        # llama.cpp frees the context, then the model and with it every adapter still loaded on it.
        self.adapters.clear()
        self.parked.clear()
        self.adapter = None
        self.llm.close()
        del self.llm
        gc.collect()
        malloc_trim()


def _common_prefix(a: Any, b: Any) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
