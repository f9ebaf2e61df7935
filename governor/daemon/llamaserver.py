"""llama.cpp's own `llama-server` as the daemon's engine (`governor run --engine llama-server`): a managed engine.

llama-server fixes threads, context, KV type, batch sizes and the model at start, so the driver changes them only by
a restart (governor.daemon.driver.Capabilities: the supervisor restarts it with the new settings). The conversation is
kept across the restart:

- before it, the slot's KV cache is saved (`POST /slots/0?action=save`; llama-server defers the save until the
  answer in progress has ended, so a restart never cuts an answer);
- after it, before the new server counts as ready, the slot is restored (`action=restore`) where llama.cpp can load
  it: the same model and KV type and a context it fits in (llama_state_seq_load_file checks the type of every layer);
- otherwise the conversation is evaluated again in the new server, in the background (a request arriving meanwhile
  waits behind it in llama-server's queue and finds it cached): the saved tokens themselves after a KV type or context
  change, the text they spell (detokenized by the old server before it stopped) after a model change.

The rate cap is the one live setting: the public socket paces streamed answers and holds the engine while it runs
ahead (governor.daemon.pacing). What it does is read from `GET /slots` (busy, the context's tokens, the decode rate),
polled: llama-server pushes nothing. A poll is a task in llama-server's queue, answered between two decode steps.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from govbase.errors import GovernorError
from governor.daemon.driver import Capabilities
from governor.daemon.pacing import Pace
from governor.daemon.polled import PolledDriver, StatusPoll, peer_pid
from governor.engine.client import EngineError, EngineStatus, EngineUnavailable, _UnixTransport
from policies.decision import EngineConfig
from policies.ladder import ModelLadder
from policies.schema import EngineOptions

CAPABILITIES = Capabilities.of("llama-server", live=["max_tokens_per_s"], reload=[])
SLOT = 0  # one slot (-np 1): one conversation, the whole context, as the built-in engine
SLOT_FILE = "governor-slot0.bin"
BUSY_POLL_S = 0.5  # how often the status is read while an answer is generated (the built-in engine writes every 1 s)
SAVE_TIMEOUT_S = 600.0  # a save waits for the answer in progress to end
SEQ_MAGIC = 0x67677371  # 'ggsq': llama_state_seq_save_file's header (llama.cpp src/llama-context.cpp)
TOKENS_MARKER = -1  # server_tokens::serialize(): LLAMA_TOKEN_NULL, a version, then the token vector
TOKENS_VERSION = 1


@dataclass(frozen=True)
class Saved:
    """The conversation saved from the server that ran `config` (`tokens` None: its file could not be read)."""

    config: EngineConfig
    flash_attn: bool
    tokens: tuple[int, ...] | None
    text: str | None = None  # the tokens as text, for a server with another model (its tokenizer)

    def restorable(self, config: EngineConfig, flash_attn: bool) -> bool:
        """llama.cpp loads a saved sequence into a context of the same model, cache types and layout, where it fits."""
        fits = self.tokens is None or len(self.tokens) < config.n_ctx
        same = (self.config.model, self.config.kv_type, self.flash_attn) == (config.model, config.kv_type, flash_attn)
        return same and fits


class LlamaServerError(GovernorError):
    pass


def read_saved_tokens(path: Path) -> tuple[int, ...] | None:
    """The token ids a slot file holds (llama_state_seq_save_file: magic, version, count, then the tokens, which
    llama-server packs as [-1, version, n, ids...]); None for a format this code does not know."""
    try:
        with path.open("rb") as f:
            magic, _version, count = struct.unpack("<III", f.read(12))
            if magic != SEQ_MAGIC or count > 1 << 22:
                return None
            packed = struct.unpack(f"<{count}i", f.read(4 * count))
    except (OSError, struct.error):
        return None
    if not packed or packed[0] != TOKENS_MARKER:
        return packed  # a plain token list (older llama-server)
    if len(packed) < 3 or packed[1] != TOKENS_VERSION or not 0 <= packed[2] <= len(packed) - 3:
        return None
    return packed[3 : 3 + packed[2]]


class LlamaServer(PolledDriver):
    """The driver (governor.daemon.driver.EngineDriver) of a llama-server child on the daemon's private socket."""

    capabilities = CAPABILITIES

    def __init__(
        self,
        program: Path,
        ladder: ModelLadder,
        socket_path: Path,
        slot_dir: Path,
        *,
        options: Callable[[], EngineOptions] = EngineOptions,
        timeout_s: float = 2.0,
        pid: Callable[[], int | None] = lambda: None,
    ) -> None:
        """`slot_dir`: where llama-server saves the slot (the daemon's own, 0700); `pid()`: the running child's pid
        (the supervisor's), which the pace holds while it runs ahead of the cap."""
        self.program, self.ladder, self.socket_path, self.slot_dir = program, ladder, socket_path, slot_dir
        self._options = options
        self.timeout_s = timeout_s
        self.pace = Pace(pid)
        self._http = httpx.Client(
            transport=_UnixTransport(socket_path), base_url="http://llama-server", timeout=timeout_s
        )
        self._lock = threading.Lock()
        self.running: EngineConfig | None = None  # what the server started last runs (its command line, the cap)
        self._saved: Saved | None = None
        self._pid: int | None = None  # the server answering on the socket (SO_PEERCRED)
        self._decoded: tuple[int, int, float] | None = None  # (task id, tokens decoded, when) at the last poll
        self._rate = 0.0
        self.poll = StatusPoll(self.status, socket_path, BUSY_POLL_S)
        self.restores = self.reevaluations = 0
        self._log = structlog.get_logger("governor.llama_server")

    # -- the process ------------------------------------------------------------------------------------------------
    def command(self, config: EngineConfig, extra_buffers: str | None) -> list[str]:
        """llama-server's argv for these settings, on the daemon's private socket (which must end in `.sock`)."""
        tier = self.ladder.get(config.model)
        self._clear_stale_socket()
        with self._lock:
            self.running = config
        self.pace.cap = config.max_tokens_per_s
        argv = [
            str(self.program),
            "--model", str(tier.path),
            "--alias", tier.name,
            "--host", str(self.socket_path),
            "--threads", str(config.threads),
            "--threads-batch", str(config.threads),
            "--ctx-size", str(config.n_ctx),
            "--cache-type-k", config.kv_type,
            "--cache-type-v", config.kv_type,
            "--flash-attn", "on" if self._flash_attn(config) else "off",
            "--batch-size", str(config.n_batch),
            "--ubatch-size", str(config.n_batch),
            "--parallel", "1",
            "--slot-save-path", str(self.slot_dir),
            "--no-webui",
            "--log-verbosity", "2",  # warnings and errors: the daemon keeps the last stderr line for a crash
        ]  # fmt: skip
        keep_alive = self._options().keep_alive_s
        if keep_alive > 0:
            argv += ["--sleep-idle-seconds", f"{max(1, round(keep_alive))}"]
        if extra_buffers == "off":
            argv.append("--no-repack")  # llama.cpp's extra buffer types off (the built-in engine's safer setting)
        return argv

    def _flash_attn(self, config: EngineConfig) -> bool:
        """A quantized V cache needs flash attention (llama.cpp refuses it otherwise); else the tier says."""
        return config.kv_type != "f16" or self.ladder.get(config.model).flash_attn

    def _clear_stale_socket(self) -> None:
        """llama-server (cpp-httplib) binds without removing a socket file a dead server left: a stale one would
        make every start fail. A socket somebody still listens on is left alone (that start then fails, saying so)."""
        path = self.socket_path
        if path.is_socket() and peer_pid(path) is None:
            path.unlink(missing_ok=True)

    def wait_ready(self, timeout_s: float) -> EngineStatus:
        """Until `GET /health` answers 200 (llama-server answers 503 while it loads); then the saved conversation
        goes into it (restored, or evaluated again in the background) before it counts as ready."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.request("GET", "/health")
                break
            except EngineError as exc:
                if time.monotonic() > deadline:
                    why = f"not ready within {timeout_s:g} s ({exc.reason})"
                    raise EngineUnavailable(self.socket_path, why) from exc
            time.sleep(0.05)
        self._pid = peer_pid(self.socket_path)
        self._decoded, self._rate = None, 0.0
        self._put_back()
        return self.status()

    # -- the conversation across a restart --------------------------------------------------------------------------
    def prepare_restart(self, config: EngineConfig) -> None:
        """The server is about to be restarted (to run `config`, or what is asked for by the time it starts): save its
        slot (waiting for the answer in progress), and the conversation as text, which another model's tokenizer
        reads."""
        with self._lock:
            running = self.running
        if running is None:
            return
        try:
            self.request("POST", f"/slots/{SLOT}?action=save", json={"filename": SLOT_FILE}, timeout_s=SAVE_TIMEOUT_S)
        except EngineError as exc:
            self._log.warning("slot not saved; the conversation will be evaluated again", error=exc.reason)
            self._saved = None
            return
        tokens = read_saved_tokens(self.slot_dir / SLOT_FILE)
        text = None
        if tokens:  # as text too: the next server may run another model (the config can change before it starts)
            with contextlib.suppress(EngineError, KeyError, TypeError):
                text = str(self.answer("POST", "/detokenize", json={"tokens": list(tokens)})["content"])
        self._saved = Saved(running, self._flash_attn(running), tokens, text)
        self._log.info("slot saved", tokens=None if tokens is None else len(tokens), model=running.model)

    def _put_back(self) -> None:
        saved, self._saved = self._saved, None
        running = self.running
        if saved is None or running is None:
            return
        if saved.restorable(running, self._flash_attn(running)):
            try:
                answer = self.answer(
                    "POST", f"/slots/{SLOT}?action=restore", json={"filename": SLOT_FILE}, timeout_s=SAVE_TIMEOUT_S
                )
                self.restores += 1
                said = answer if isinstance(answer, dict) else {}
                self._log.info("slot restored", tokens=said.get("n_restored"), ms=said.get("timings"))
                return
            except EngineError as exc:
                self._log.warning("slot not restored; evaluating the conversation again", error=exc.reason)
        # the same model: its tokens; another: their text (the other tokenizer reads it)
        prompt = saved.text if saved.config.model != running.model else list(saved.tokens or ())
        if prompt:
            threading.Thread(target=self._evaluate, args=(prompt,), name="llama-server-reevaluate", daemon=True).start()

    def _evaluate(self, prompt: list[int] | str) -> None:
        """The conversation evaluated into the new server's cache (`n_predict` 0: nothing generated)."""
        body = {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": SLOT}
        try:
            answer = self.answer("POST", "/completion", json=body, timeout_s=SAVE_TIMEOUT_S)
        except EngineError as exc:
            self._log.warning("conversation not evaluated again; the next turn will", error=exc.reason)
            return
        self.reevaluations += 1
        said = answer if isinstance(answer, dict) else {}
        self._log.info("conversation evaluated again", tokens=said.get("tokens_evaluated"))

    # -- what it does -----------------------------------------------------------------------------------------------
    def status(self) -> EngineStatus:
        slots = self.answer("GET", "/slots")
        try:
            slot = next(s for s in slots if s.get("id") == SLOT)
        except (StopIteration, TypeError, AttributeError) as exc:
            raise EngineError(self.socket_path, 200, f"unexpected /slots answer: {slots!r:.200}") from exc
        busy = bool(slot.get("is_processing"))
        with self._lock:
            running = self.running
        if running is None:
            raise EngineUnavailable(self.socket_path, "no llama-server started")
        context = slot.get("n_prompt_tokens")
        return EngineStatus(
            **running.model_dump(exclude={"max_tokens_per_s"}),
            max_tokens_per_s=self.pace.cap,
            busy=busy,
            tokens_per_s=self._decode_rate(slot, busy),
            context_tokens=context if isinstance(context, int) and 0 <= context <= 1 << 20 else None,
            loaded=True,
            pid=self._pid,
            engine="llama-server",
        )

    def _decode_rate(self, slot: dict[str, Any], busy: bool) -> float:
        """Tokens decoded per second between two polls of the same answer (0 while idle), lightly smoothed."""
        now = time.monotonic()
        task, decoded = slot.get("id_task"), 0
        with contextlib.suppress(KeyError, IndexError, TypeError, ValueError, OverflowError):
            n = int(slot["next_token"][0]["n_decoded"])
            decoded = n if 0 <= n <= 1 << 31 else 0  # the server's number: bounded like context_tokens
        last, self._decoded = self._decoded, (task if isinstance(task, int) else -1, decoded, now)
        if not busy:
            self._rate = 0.0
        elif last is not None and last[0] == task and now > last[2] and decoded >= last[1]:
            rate = (decoded - last[1]) / (now - last[2])
            self._rate = rate if self._rate == 0.0 else 0.5 * self._rate + 0.5 * rate
        return round(self._rate, 2)

    def on_chat(self, started: bool) -> None:
        """A chat came in (read the status now: an idle server is polled only at the heartbeat) or ended."""
        if started:
            self.poll.kick()

    # -- what it is told --------------------------------------------------------------------------------------------
    def apply(self, config: EngineConfig) -> None:
        """Only a live change comes here (the rest restarts the server): the rate cap, which the socket paces."""
        with self._lock:
            running = self.running
            if running is not None and CAPABILITIES.how(running, config) == "restart":
                raise LlamaServerError(f"llama-server cannot change {running.describe(config)} running; restart it")
            self.running = config
        self.pace.cap = config.max_tokens_per_s

    def pause(self, reason: str | None) -> None:
        """Nothing fits in memory: llama-server cannot unload its model and keep an answer waiting, so its slot is
        saved (once the answer in progress ends) and the supervisor stops the idle server until memory is back."""
        if reason is not None:
            with self._lock:
                running = self.running
            if running is not None:
                self.prepare_restart(running)

    def close(self) -> None:
        self.interrupt_streams()
        self._http.close()

    # -- plumbing ---------------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, *, json: object = None, timeout_s: float | None = None) -> httpx.Response:
        timeout = httpx.Timeout(timeout_s if timeout_s is not None else self.timeout_s, connect=self.timeout_s)
        try:
            response = self._http.request(method, path, json=json, timeout=timeout)
        except httpx.TransportError as exc:
            raise EngineUnavailable(self.socket_path, f"cannot reach llama-server ({exc!s:.200})") from exc
        if response.is_error:
            raise EngineError(self.socket_path, response.status_code, _message(response))
        return response

    def answer(self, method: str, path: str, *, json: object = None, timeout_s: float | None = None) -> Any:
        """The JSON of an answer. One that is not JSON is the server's error like an HTTP error (EngineError), not a
        ValueError that would escape the supervisor's and the settings thread's handling."""
        response = self.request(method, path, json=json, timeout_s=timeout_s)
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(self.socket_path, response.status_code, f"not JSON: {response.text!r:.200}") from exc


def _message(response: httpx.Response) -> str:
    """llama-server's errors are {"error": {"code", "message", "type"}}."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:200] or response.reason_phrase
    return " ".join(str(message).split())[:400]
