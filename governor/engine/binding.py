"""What the engine adds to llama-cpp-python: a `Llama` that reports load progress, takes llama.cpp's extra-buffers
switch, counts the tokens it evaluates and hands a rebuilt context's sampler the answer so far; llama.cpp's log lines
captured while a load or an adapter init lasts (its log callback is process-wide); and glibc's malloc_trim. The
engine's model (governor.engine.model) is built on these; every load goes through its `open_llama`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import llama_cpp


class Llama(llama_cpp.Llama):
    """`Llama` whose next sampler first accepts `replay` (the answer's tokens so far): after a rebuilt context the
    grammar (structured output, tool calls) and the repetition penalties go on from where the answer is, instead of
    from its start. `generate()` builds the sampler lazily, at its first step, so the tokens are handed over here."""

    replay: Sequence[int] = ()

    def __init__(
        self,
        *args: Any,
        on_progress: Callable[[float], None] | None = None,
        extra_buffers: bool = True,
        **kwargs: Any,
    ) -> None:
        self._on_progress = on_progress
        self._extra_buffers = extra_buffers
        super().__init__(*args, **kwargs)

    # `Llama` takes no progress callback (llama-cpp-python 0.3.36; upstream PR #2340 adds one). Its __init__ assigns
    # `self.model_params` once, before it loads the model: this setter puts llama.cpp's callback into that struct.
    @property
    def model_params(self) -> Any:
        return self._model_params

    # The same way, `use_extra_bufts` (no `Llama` argument either; see governor.engine.extra_buffers): llama.cpp's
    # default is true.
    @model_params.setter
    def model_params(self, params: Any) -> None:
        params.use_extra_bufts = self._extra_buffers
        on_progress = self._on_progress
        if on_progress is not None:

            def progress(fraction: float, _data: object) -> bool:
                on_progress(fraction)
                return True  # go on loading

            self._progress_cb = llama_cpp.llama_progress_callback(progress)  # kept alive with the model
            params.progress_callback = self._progress_cb
        self._model_params = params

    evaluated = 0  # tokens llama.cpp has evaluated in this context (prompts, re-evaluations, decoded tokens)

    def eval(self, tokens: Sequence[int]) -> None:
        before = self.n_tokens
        try:
            super().eval(tokens)
        finally:  # an aborted evaluation still counts the batches it completed
            self.evaluated += self.n_tokens - before

    def _init_sampler(self, *args: Any, **kwargs: Any) -> Any:
        sampler = super()._init_sampler(*args, **kwargs)
        for token in self.replay:
            llama_cpp.llama_sampler_accept(sampler.sampler, token)
        self.replay = ()
        return sampler


_LOG_LOCK = threading.Lock()  # llama.cpp's log callback is process-wide


_BUFFER_LINE = re.compile(rb"(\S+) model buffer size =\s*([0-9.]+) MiB")


@contextlib.contextmanager
def weight_buffers(found: dict[str, float]) -> Iterator[None]:
    """Collect llama.cpp's "<buffer type> model buffer size = N MiB" load lines into `found`: the buffer types the
    weights really went to, as llama.cpp reports them (AMX or CPU_REPACK only with extra buffers on)."""

    def record(text: bytes) -> None:
        m = _BUFFER_LINE.search(text)
        if m:
            name = m[1].decode(errors="replace")
            found[name] = round(found.get(name, 0.0) + float(m[2]), 2)

    with llama_log(record):
        yield


@contextlib.contextmanager
def llama_log(on_text: Callable[[bytes], None]) -> Iterator[None]:
    """llama.cpp's log lines go to `on_text` too while this lasts (its log callback is process-wide)."""
    from llama_cpp import _logger

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def record(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        on_text(text)
        _logger.llama_log_callback(level, text, user_data)  # llama-cpp-python's own handling, unchanged

    with _LOG_LOCK:
        llama_cpp.llama_log_set(record, ctypes.c_void_p(0))
        try:
            yield
        finally:
            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def malloc_trim() -> None:
    """Give freed heap pages back to the OS now (glibc keeps them otherwise); a no-op without glibc."""
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _libc_malloc_trim() -> Any:
    # find_library runs `ldconfig -p` in a subprocess: once per process is enough.
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
