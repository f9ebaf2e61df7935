"""The simulated engine: a llama.cpp process as seen from outside (speed, memory, reloads), driven by a workload.

Decode speed per token is the lesser of compute (threads x clock x a thread's tokens/s, the slowest core setting the
pace, shared with background work at a barrier cost) and memory bandwidth (all weights and the KV cache read per
token), under the rate cap; prefill is compute-bound at the n_batch's efficiency. The formulas and where each figure
comes from: docs/lab.md, "The engine".

The context (governor.lab.conversation) follows the real engine's rules (docs/lab.md): a turn evaluates only its
new tokens, an overflow shifts the cache (drops its older half), and the reconfiguration plan (governor.engine.plan)
decides the rest: an n_ctx change copies the cache into the new context; a KV type or model change (or a restart)
evaluates the conversation again, a KV type change mid-answer warm where the real engine would do it
(governor.lab.swap), the answer going on meanwhile, else cold (the answer stops until it is evaluated again).
"""

from __future__ import annotations

from governor.engine import plan
from governor.lab import restart, swap
from governor.lab.adapters import SimPool
from governor.lab.answering import Answering
from governor.lab.conversation import Conversation
from governor.lab.device import MB, CpuSpec, EngineSpec, SimModelSpec
from governor.lab.procmem import ProcessMemory
from governor.lab.speed import UNPLACED, decode_rate, place, prefill_rate
from governor.lab.stats import EngineStats, batch_efficiency
from governor.lab.swap import WarmSwap
from governor.lab.workload import Request
from policies.decision import EngineConfig


class EngineSim:
    """One engine process: loads the model a config names, serves requests one at a time, can be OOM-killed."""

    def __init__(self, spec: EngineSpec, cpu: CpuSpec) -> None:
        self.spec = spec
        self.cpu = cpu
        self.placed = UNPLACED  # the threads on the cores
        self._prefill_eff = 1.0  # prompt evaluation speed at this n_batch relative to 512
        self._kv_per_tok = 0.0
        self.memory = ProcessMemory(spec)
        self.config: EngineConfig | None = None
        self.affinity: tuple[int, ...] | None = None  # the CPUs the threads may run on (None: any)
        self._swap: WarmSwap | None = None  # a KV type change being built beside the answering context
        self._deferred: EngineConfig | None = None  # llama-server: a restart waiting for the answer in progress
        self.tier: SimModelSpec | None = None
        self.loaded = False
        self.stopped = False  # stopped because nothing fits in memory (requests wait in the queue)
        self.off = False  # the device powered off (a critical trip): every request fails from then on
        self.paused = False  # of which: the answer in progress kept, its process alive without its model
        self.waiting: str | None = None  # the decision's engine_wait: stop once the answer in progress is done
        self.ready_s = 0.0  # loading (or restarting) until then
        self.chat = Conversation()  # the conversation as the process holds it (the KV cache) and must evaluate
        self.stats = EngineStats()
        self.answering = Answering(self.stats)  # the queue, the answer in progress
        self.uncapped_tokens_per_s: float | None = None  # the last decode speed without the rate cap (measured)
        self.prefill_tokens_per_s: float | None = None  # the last prefill speed
        sizes = {a.name: a.size_mb for a in spec.adapter}
        self.pool = SimPool(
            sizes, switch_s=spec.adapter_switch_s, load_mb_s=spec.load_mb_s, cached_mb_s=spec.cached_load_mb_s
        )

    # --- control (the loop's actuator, governor.lab.twins.SimulatedEngine) ---

    def apply(self, config: EngineConfig, t: float) -> None:
        old = self.config
        if self.spec.kind == "llama-server" and old is not None and restart.needed(old, config):
            self._restart_for(config, t)
            return
        if self._swap is not None:  # a newer change waits for the build and applies on top of it
            self._swap.then = config
            return
        if old is not None and self._start_swap(old, config, t):
            return
        self._set(config)
        if self.stopped:
            return  # started with this config once memory comes back
        if old is None:
            self.stats.starts += 1
        step = "new_model" if old is None else plan.kind(old, config)
        if step == "new_model":
            self._reload(t, delay_s=0.0, weights=True)
        elif step == "new_cache":
            self._reload(t, delay_s=0.0, weights=False)
        elif step == "resize":
            self._resize(t)  # n_batch too is fixed when a context is built

    def _restart_for(self, config: EngineConfig, t: float) -> None:
        """llama-server: a change it fixes at start waits for the answer in progress (the slot's save does), then
        the server restarts: its start, the weights from the page cache (from storage for a model not read before),
        the context, and the slot restored (read back) where llama.cpp can load it; else the conversation is
        evaluated again before the next turn."""
        if self.answering.current is not None or self.stopped:
            self._deferred = config  # the latest asked for goes at the answer's end (or the next start)
            if self.stopped:
                self._set(config)
            return
        assert self.config is not None
        old, self._deferred = self.config, None
        self._set(config)
        self.stats.restarts += 1
        assert self.tier is not None
        weights = self.memory.read_s(self.tier)
        if restart.restorable(old, config, self.chat.ctx):
            self.stats.restores += 1
            kv_s = self.chat.ctx * self._kv_per_tok / (self.spec.cached_load_mb_s * MB)
            self.ready_s = t + self.spec.server_start_s + weights + self.spec.context_s + kv_s
            return
        self._reload(t, delay_s=self.spec.server_start_s, weights=True)

    def _set(self, config: EngineConfig) -> None:
        """The figures the engine runs with under `config`."""
        self.config = config
        self.tier = tier = self.spec.tier(config.model)
        self._place()
        self._kv_per_tok = tier.kv_bytes_per_token(config.kv_type)
        self.memory.set(tier, config)
        self._prefill_eff = batch_efficiency(config.n_batch)
        self.pool.resize(config.lora_pool_mib * MB)

    def set_affinity(self, cpus: tuple[int, ...] | None) -> None:
        """The CPUs the threads may run on (the daemon's affinity actuator); None: any, big cores first (the
        scheduler's energy-aware placement moves busy threads to big cores)."""
        if cpus != self.affinity:
            self.affinity = cpus
            if self.config is not None:
                self._place()

    def _place(self) -> None:
        assert self.config is not None
        self.placed = place(self.cpu, self.config.threads, self.affinity, self.spec.barrier_efficiency)

    def _resize(self, t: float) -> None:
        """An n_ctx (or n_batch) change with the same model and KV type: a new context, the sequence's cache copied
        into it (`llama_state_seq_get_data` / `_set_data`); nothing is evaluated again. As in the engine, a cache that
        does not fit the smaller context is not copied: the conversation is evaluated again instead."""
        assert self.config is not None
        if not plan.cache_fits(self.chat.ctx, self.config.n_ctx):
            self._reload(t, delay_s=0.0, weights=False)
            return
        self.stats.resizes += 1
        self.ready_s = max(self.ready_s, t + self.spec.context_s)
        a = self.answering
        if a.current is not None:
            a.answer_left = max(0.0, min(a.answer_left, self.config.n_ctx - self.chat.ctx - a.prefill_left))

    def _reload(self, t: float, delay_s: float, *, weights: bool) -> None:
        """A new KV type or model means a fresh KV cache: the kept conversation (up to half the new context) is
        evaluated again, in n_batch chunks that a newer change interrupts (the sim applies a change at once)."""
        assert self.tier is not None
        assert self.config is not None
        self.stats.reloads += 1
        load_s = self.spec.context_s
        if weights:
            self.loaded = False
            load_s += self.memory.read_s(self.tier)
        self.ready_s = t + delay_s + load_s
        if weights:  # llama.cpp freed the adapters with the old model; the next request loads its own again
            self.pool.forget()
        half, a = self.config.n_ctx // 2, self.answering
        if a.current is not None:
            a.prefill_left = min(self.chat.ctx + a.prefill_left, half)
            a.answer_left = min(a.answer_left, self.config.n_ctx - a.prefill_left)
        else:
            self.chat.history = self.chat.pending = min(self.chat.ctx + self.chat.pending, half)
        self.chat.ctx = 0.0

    def _start_swap(self, old: EngineConfig, config: EngineConfig, t: float) -> bool:
        """Build `config` warm beside the answering context when the real engine would (governor.lab.swap)."""
        if self.answering.current is None or self.stopped or not self.loaded or t < self.ready_s:
            return False  # between answers (or while loading) a change is cold: no answer waits for it
        assert self.tier is not None
        if plan.kind(old, config) != "new_cache":
            return False
        built = swap.start(
            old,
            config,
            tier=self.tier,
            threads=self.placed.big + self.placed.little,
            tokens=self.chat.ctx + self.answering.prefill_left,
            answer_left=self.answering.answer_left,
            available=self.memory.room_bytes - self.resident_bytes(),
            now=t,
            context_s=self.spec.context_s,
        )
        if isinstance(built, str):
            self.stats.cold_why.append(built)
            return False
        self._swap = built
        return True

    def _switch(self, now: float) -> None:
        """The new context is ready: the answer goes on in it with all threads, after evaluating the few tokens that
        came since its last round; the old context is freed. A newer change then applies on top."""
        sw, self._swap = self._swap, None
        assert sw is not None
        self._set(sw.target)
        self.stats.reloads += 1
        self.stats.warm_swaps += 1
        a = self.answering
        if a.current is not None:
            a.prefill_left += self.chat.ctx - sw.done
            a.answer_left = min(a.answer_left, sw.target.n_ctx - sw.done - a.prefill_left)
        else:  # the answer ended meanwhile: the next turn evaluates the rest of it (prefix reuse)
            self.chat.pending += self.chat.ctx - sw.done
        self.chat.ctx = sw.done
        if sw.then is not None:
            self.apply(sw.then, now)

    def _drop_swap(self) -> None:
        """The process stops, pauses or dies: the second context goes with it, the change applies at the next load."""
        if self._swap is not None:
            sw, self._swap = self._swap, None
            self._set(sw.then or sw.target)

    def wait(self, reason: str | None, t: float) -> None:
        """Nothing fits (`reason`), as the daemon and the engine do it: an answer in progress is paused at once (the
        model unloaded, the process and the client's stream kept), an idle engine is stopped; new requests wait in
        the queue. None: memory is back: a paused engine loads its model again and evaluates the answer's context
        again, then continues it; a stopped one starts again (the kept conversation is evaluated again)."""
        self.waiting = reason
        if reason is not None and not self.stopped:
            if self.answering.current is None:
                self._stop()
            else:
                self._drop_swap()
                self.stopped = self.paused = True
                self.loaded = False
        elif reason is None and self.stopped and self.config is not None:
            self.stopped = False
            if self.paused:  # the process is there: only the model is loaded again
                self.paused = False
                self._reload(t, delay_s=0.0, weights=True)
                return
            self.stats.starts += 1
            self._reload(t, delay_s=self.spec.restart_s, weights=True)

    def _stop(self) -> None:
        self._drop_swap()
        self.stopped, self.loaded, self.paused = True, False, False
        self.chat.pending, self.chat.ctx = self.chat.ctx + self.chat.pending, 0.0

    def footprint_bytes(self) -> int:
        return self.memory.footprint + int(self.pool.held_bytes())

    def _beside(self) -> tuple[float, float]:
        """What the process holds beside its settings' footprint: the LoRA pool, a warm swap's second context."""
        return self.pool.held_bytes(), self._swap.extra_bytes if self._swap is not None else 0.0

    def unreclaimable_bytes(self) -> float:
        """What the kernel cannot take back from the loaded process short of killing it (governor.lab.procmem)."""
        return self.memory.unreclaimable(*self._beside())

    def resident_bytes(self) -> int:
        """The process's memory: all of it once loaded (governor.lab.procmem), its runtime alone while paused (model
        unloaded)."""
        if self.loaded:
            return self.memory.resident(*self._beside())
        return int(self.spec.overhead_mb * MB) if self.paused else 0

    def anon_bytes(self) -> int:
        """Of resident_bytes, what is not the mapped weights' page cache (the kernel's RssAnon)."""
        return self.memory.anon(*self._beside()) if self.loaded else self.resident_bytes()

    def memory_left(self, room_bytes: float, t: float) -> None:
        """Other programs leave `room_bytes`: the kernel kills the process once what it cannot reclaim exceeds it."""
        self.memory.room_bytes = room_bytes
        if self.loaded and self.unreclaimable_bytes() > room_bytes:
            self.oom_kill(t)

    def oom_kill(self, t: float) -> None:
        """The kernel kills the process: the answer in progress is lost; the daemon starts it again."""
        self.stats.oom_kills += 1
        self._drop_swap()
        self.memory.drop_cache()
        self.answering.killed(t)
        if self.waiting is not None:  # nothing fits: the daemon does not start it into the same wall
            self._stop()
            return
        self.stats.starts += 1
        self._reload(t, delay_s=self.spec.restart_s, weights=True)

    # --- serving ---

    def submit(self, request: Request) -> None:
        if self.off:
            self.answering.failed(request.arrival_s)
            return
        self.answering.queue.append(request)

    def power_off(self, t: float) -> None:
        """The kernel powered the device off at a critical trip: the answer in progress and the queued requests fail,
        and so does every request after (`submit`); nothing runs again in the run."""
        self.off = True
        self._stop()
        self.answering.killed(t)
        while self.answering.queue:
            self.answering.queue.popleft()
            self.answering.failed(t)

    def busy(self) -> bool:
        return self.answering.current is not None or bool(self.answering.queue) or self._swap is not None

    def share(self, background: float) -> float:
        """Each engine thread's share of a core while it runs beside `background` cores' worth of other work."""
        return self.placed.share(self.cpu.cores, background)

    def step(  # noqa: PLR0915 (hot path)
        self, t: float, h: float, freq_ratio: float, background: float = 0.0
    ) -> tuple[float, float]:
        """Run for h seconds at the given CPU frequency beside `background` cores of other work; returns the mean
        busy (big, little) cores in the step."""
        if self.config is None or self.tier is None or self.stopped:
            return 0.0, 0.0
        if t + h <= self.ready_s:
            return 0.0, 0.0
        self.loaded = True
        cfg, tier, a = self.config, self.tier, self.answering
        share = self.share(background)
        slowdown = 1.0 if share >= 1.0 else share * self.spec.barrier_efficiency
        placed = self.placed
        compute = placed.speed * freq_ratio * slowdown
        kv_per_tok, weights = self._kv_per_tok, self.memory.weights
        # Thrashing: the evicted weights come from storage once per decoded token and once per prompt batch.
        reread_s = self.memory.evicted(*self._beside()) / (self.spec.load_mb_s * MB)
        now = max(t, self.ready_s)
        end = t + h
        busy = 0.0  # seconds of all threads' work
        n = placed.big + placed.little
        while now < end - 1e-12:
            sw = self._swap
            if sw is not None and sw.due(now, self.chat.ctx + a.prefill_left):
                duty = busy / h * share
                big, little = placed.big * duty, placed.little * duty
                self._switch(now)  # a new config: the rest of the step runs with it
                more = self.step(now, end - now, freq_ratio, background)
                return big + more[0] * (end - now) / h, little + more[1] * (end - now) / h
            if a.current is None and sw is None:
                if self._deferred is not None:  # llama-server: the change that waited for the answer
                    self._restart_for(self._deferred, now)
                    break
                if self.waiting is not None:
                    self._stop()
                    break
                a.next(now, cfg.n_ctx, self.pool, self.chat)
                if a.current is None:
                    break
            left = end - now
            on = 1.0  # the answering context's share of the threads (half of them build a warm swap's context)
            swap_rate = 0.0
            if sw is not None:
                on = (n - sw.threads) / n
                if now >= sw.ready_s:
                    swap_rate = (
                        compute * sw.threads / n * tier.prefill_thread_tok_s * batch_efficiency(sw.target.n_batch)
                    )
                left = min(left, sw.until(now, swap_rate))
                if a.current is None or sw.then is not None:  # the answer (or the next) waits for the build
                    on = 0.0
            if on == 0.0:
                spent = left
            elif a.stall > 0:  # the answer's adapter: loading it, re-reserving the graph
                spent = min(left, a.stall)
                a.stall -= spent
                busy += spent * on
            elif a.prefill_left > 0:
                rate, computing = prefill_rate(compute * on, tier, self._prefill_eff, reread_s, cfg.n_batch)
                self.prefill_tokens_per_s = rate
                spent = min(left, a.prefill_left / rate)
                done = rate * spent
                a.prefill_left -= done
                self.chat.ctx += done
                self.stats.prefill_tokens += done
                busy += spent * rate / computing * on  # waiting for storage is not CPU work
                if a.prefill_left <= 1e-9:
                    a.prefill_left = 0.0
            else:
                assert a.current is not None
                limit, computing = decode_rate(
                    compute * on, tier, bandwidth_gb_s=self.spec.bandwidth_gb_s,
                    bytes_per_token=weights + kv_per_tok * self.chat.ctx, slowdown=slowdown, reread_s=reread_s,
                )  # fmt: skip
                self.uncapped_tokens_per_s = limit
                rate = min(limit, cfg.max_tokens_per_s) if cfg.max_tokens_per_s else limit
                spent = min(left, a.answer_left / rate)
                done = rate * spent
                a.decoded(done, now, rate, self.chat)
                self.stats.decoded(done, spent, rate)
                busy += spent * rate / computing * on
                if a.answer_left <= 1e-9:
                    a.ended(now + spent, self.chat)
            if swap_rate:
                assert sw is not None
                sw.done = min(sw.goal, sw.done + swap_rate * spent)
                self.stats.prefill_tokens += swap_rate * spent
                busy += spent * sw.threads / n
            now += spent
        duty = busy / h * share  # a descheduled thread is not running (spinning at the barrier counts as running)
        return self.placed.big * duty, self.placed.little * duty  # a deferred restart may have placed them anew
