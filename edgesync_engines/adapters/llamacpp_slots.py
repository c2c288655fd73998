"""Slots: several conversations answered at once from one llama.cpp context, each answer
bit-identical to the same request answered alone.

:class:`SlotEngine` opens one context with a KV stream per sequence (``n_seq_max`` = slots,
``kv_unified`` off, ``n_ctx`` per slot) and one :class:`~.step_loop.StepLoop` that batches the
sequences' evaluations. Each slot is a :class:`SlotAdapter`: an ``EngineAdapter`` on one sequence,
so the request path drives a slot as it drives a whole engine. Why a KV stream per sequence: with
one unified buffer the other sequences' cells change the attention's sums (docs/engines.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator, Sequence

import llama_cpp
import numpy as np

from edgesync_engines.adapters import seqstate
from edgesync_engines.adapters.kv_layout import turn_batches
from edgesync_engines.adapters.llamacpp import DEFAULT_N_CTX, ROW_PROBE_TEXT, LlamaCppAdapter
from edgesync_engines.adapters.protocol import EngineAdapter, EvaluationAborted, check_generation
from edgesync_engines.adapters.step_loop import END, Job, StepLoop

log = logging.getLogger(__name__)

ROWS_PROBE_FILL = 300
"""Tokens the other sequence holds in :meth:`SlotEngine.probe_rows`: past 256, so that the two
streams' padded KV lengths differ (``llama_kv_cache::get_n_kv`` pads to 256 cells)."""


PREFILL_CHUNK_TOKENS = 128
"""Most tokens of a prefill batch in slots (cut where the KV stays bit-identical,
``kv_layout.turn_batches``): the other slots' decode steps run between two batches."""


class SlotsRefused(ValueError):
    """The model cannot be served in slots (the caller serves it with one sequence)."""


class SlotEngine:
    """One llama.cpp context serving ``slots`` sequences, and its step loop.

    Args:
        model: a GGUF path (None: the configured model).
        slots: sequences (>= 1), each with ``n_ctx`` tokens of context and its own KV stream.
        n_threads, flash_attn, verbose, seed, kv_type: as :class:`LlamaCppAdapter`'s.

    Attributes:
        adapters: one :class:`SlotAdapter` per slot, by sequence id.
        shared_rows: the most decode rows one ``llama_decode`` holds (:meth:`probe_shared_rows`).

    Raises what ``LlamaCppAdapter`` raises, ValueError (``slots`` below 1), and
    :class:`SlotsRefused` for a sliding-window model (its window's KV is captured batch by batch,
    which the loop does not do yet).
    """

    def __init__(self, model: "str | os.PathLike | None" = None, slots: int = 2, n_ctx: int = DEFAULT_N_CTX,
                 n_threads: int | None = None, flash_attn: bool = False, verbose: bool = False, seed: int = 0,
                 kv_type: str = "f16") -> None:
        if slots < 1:
            raise ValueError(f"slots: must be >= 1, got {slots}")
        self.owner = LlamaCppAdapter(model, n_ctx=n_ctx * slots, n_threads=n_threads, flash_attn=flash_attn,
                                     verbose=verbose, seed=seed, kv_type=kv_type, n_seq_max=slots, kv_unified=False)
        llm = self.owner.llm
        if int(llama_cpp.llama_model_n_swa(llm.model)) > 0:
            self.owner.close()
            raise SlotsRefused(f"{self.owner.model_path.name}: a sliding-window model is served with one sequence")
        self.n_ctx = min(int(llama_cpp.llama_n_ctx_seq(llm.ctx)), n_ctx)
        self.slots = slots
        self.shared_rows = self.probe_shared_rows() if slots > 1 else 1
        if self.shared_rows < slots:
            log.warning("%s: a decode row is bit-identical beside at most %d other sequences' rows: each step "
                        "decodes at most %d slots' tokens at once (exact, but slower)", self.owner.model_path.name,
                        self.shared_rows - 1, self.shared_rows)
        self.loop = StepLoop(llama_cpp, llm.ctx, max(int(llm.n_batch), slots), self.shared_rows)
        self.state_buf = None
        """The seq-state buffer (uint8) every slot's injections build in and reads land in, one
        slot at a time (``buffer_lock``): ``llama_state_seq_set_data`` copies it into the slot's
        KV stream, and a read is cut into fragments (copies) before the next."""
        self.buffer_lock = threading.Lock()
        self.adapters = [SlotAdapter(self, seq) for seq in range(slots)]
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def probe_shared_rows(self) -> int:
        """The most decode rows of consecutive sequences one ``llama_decode`` may hold, each
        row's logits (float32) bit for bit those of the row alone: one row beside a sequence of
        :data:`ROWS_PROBE_FILL` cells (past a KV padding step), then ``m`` sequences' rows
        together for ``m`` = 2 .. slots; the first ``m`` that differs ends it (ggml's repacked
        Q4_K kernels, for one, compute rows by fours). 1: every row alone. The KV memory is
        empty after."""
        c, llm = llama_cpp, self.owner.llm
        tokens = llm.tokenize(ROW_PROBE_TEXT, add_bos=True)
        fill = (tokens * (ROWS_PROBE_FILL // len(tokens) + 1))[:ROWS_PROBE_FILL]
        mem, n_vocab, n = c.llama_get_memory(llm.ctx), llm.n_vocab(), len(tokens)
        batch = c.llama_batch_init(max(len(fill), self.slots), 0, 1)

        def decode(rows):
            for i, (token, pos, seq, want) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, want
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(rows)
            if c.llama_decode(llm.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            return [np.ctypeslib.as_array(c.llama_get_logits_ith(llm.ctx, i), shape=(n_vocab,)).copy()
                    for i, row in enumerate(rows) if row[3]]

        def heads(m: int) -> None:
            c.llama_memory_clear(mem, True)
            for seq in range(m):
                decode([(t, i, seq, False) for i, t in enumerate(tokens[:-1])])

        try:
            heads(1)
            alone = decode([(tokens[-1], n - 1, 0, True)])[0]
            heads(1)
            decode([(t, i, 1, False) for i, t in enumerate(fill[:-1])])
            if not np.array_equal(alone, decode([(tokens[-1], n - 1, 0, True), (fill[-1], len(fill) - 1, 1, True)])[0]):
                return 1
            for m in range(2, self.slots + 1):
                heads(m)
                if not all(np.array_equal(alone, x) for x in decode([(tokens[-1], n - 1, s, True) for s in range(m)])):
                    return m - 1
            return self.slots
        except RuntimeError as exc:
            log.debug("slot row probe failed: %s", exc)
            return 1
        finally:
            c.llama_memory_clear(mem, True)
            c.llama_batch_free(batch)

    def set_threads(self, n_threads: int) -> None:
        """``llama_set_n_threads`` for every slot (ValueError below 1)."""
        if n_threads < 1:
            raise ValueError(f"set_threads: n_threads must be >= 1, got {n_threads}")
        with self.loop.ctx_lock:
            llama_cpp.llama_set_n_threads(self.owner.llm.ctx, n_threads, n_threads)

    def close(self) -> None:
        """Wait for each slot's current user (its lock), then stop the loop and free the
        context. Idempotent."""
        if self._closed:
            return
        held = getattr(self, "adapters", [])
        for adapter in held:
            adapter.lock.acquire()
        try:
            self._closed = True
            self.loop.close()
            self.owner.close()
        finally:
            for adapter in held:
                adapter.lock.release()


class SlotAdapter(LlamaCppAdapter):
    """One slot of a :class:`SlotEngine`: an ``EngineAdapter`` on its sequence. Its evaluations
    run in the engine's step loop; every other call on the context holds the loop's lock.

    ``generate`` queues the prompt's last batch with a sampler, and the loop decodes the answer
    ahead of the reader; closing the generator cancels the rest. Stored KV cannot move position in
    a slot (:attr:`blend_refusal`); ``abortable`` stops a batch only before the loop starts it.
    Injections build their state in the engine's one buffer, a slot at a time.
    ``close`` closes the whole engine.
    """

    def __init__(self, engine: SlotEngine, seq: int) -> None:  # not the parent's: the engine's probe is shared
        engine.owner.copy_probe_to(self)
        self.engine, self.seq = engine, seq
        self.lock = threading.RLock()
        self.n_ctx = engine.n_ctx
        self.blend_refusal = self.cache_refusal or "slots: stored KV cannot move position in a slot's KV stream"
        self._ids = np.zeros(self.n_ctx, dtype=np.intc)
        self._n = 0
        self._stop: Callable[[], bool] | None = None
        self._tokens_left = 0  # of the prompt being prefilled, for the loop's order
        self.kv_epoch = 0
        if not self.flash_attn:  # cut prefill batches are bit-identical only without flash attention
            self.turn_tokens = PREFILL_CHUNK_TOKENS

    @property
    def closed(self) -> bool:
        return self.engine.closed

    @property
    def n_tokens(self) -> int:
        return self._n

    def _live_tokens(self, end: int) -> np.ndarray:
        return self._ids[:end]

    def _hold(self, tokens: Sequence[int], n_tokens: int) -> None:
        self._ids[:n_tokens] = np.asarray(tokens[:n_tokens], dtype=np.intc)
        self._n = n_tokens

    def _truncate(self, n: int) -> None:
        self._remove_from(n)

    def _remove_from(self, n: int) -> None:
        """Drop the sequence's cells from position ``n`` on; it then holds ``n`` tokens."""
        with self.engine.loop.ctx_lock:
            self._llama_cpp.llama_memory_seq_rm(self._mem, self.seq, n, -1)
        self._n = min(self._n, n)

    def _get_state(self, flags: int = 0) -> memoryview:
        """The sequence's state, read into the engine's one buffer (the caller holds its
        ``buffer_lock`` while it uses the view: :meth:`_span_kv`)."""
        c, engine = self._llama_cpp, self.engine
        with engine.loop.ctx_lock:
            size = c.llama_state_seq_get_size_ext(self._ctx, self.seq, flags)
            if engine.state_buf is None or len(engine.state_buf) < size:
                engine.state_buf = np.empty(size, np.uint8)
            dst = (ctypes.c_uint8 * size).from_buffer(engine.state_buf)
            written = c.llama_state_seq_get_data_ext(self._ctx, dst, size, self.seq, flags)
        if written != size:
            raise seqstate.SeqStateError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return memoryview(engine.state_buf)[:size]

    def _span_kv(self, spans, layers, head_start: int, head_end: int):
        with self.engine.buffer_lock:  # one slot at a time reads its state into the shared buffer
            return super()._span_kv(spans, layers, head_start, head_end)

    def _set_state(self, buf: np.ndarray, size: int) -> int:
        with self.engine.loop.ctx_lock:
            return super()._set_state(buf, size)

    @property
    def _state_buf(self):
        return self.engine.state_buf

    @_state_buf.setter
    def _state_buf(self, buf) -> None:
        self.engine.state_buf = buf

    def _load_blocks(self, blocks, n_tokens: int, tokens: Sequence[int], on_chunk=None) -> None:
        with self.engine.buffer_lock:  # one buffer for every slot's injections
            super()._load_blocks(blocks, n_tokens, tokens, on_chunk)

    def make_room(self, n_tokens: int, should_stop: Callable[[], bool] | None = None) -> bool:
        with self.engine.buffer_lock:
            return super().make_room(n_tokens, should_stop)

    def clear_kv_cache(self) -> None:
        """Empty this slot's KV stream (``llama_memory_seq_rm`` of its sequence) and forget its tokens."""
        self.kv_epoch += 1
        self._remove_from(0)

    def _evaluate(self, batch: Sequence[int]) -> None:
        """One batch through the loop (inside :meth:`abortable`: background work); EvaluationAborted
        when ``should_stop`` said so before the loop took it."""
        job = self.engine.loop.submit(Job(self.seq, batch, self._n, tokens_left=self._tokens_left,
                                          background=self._stop is not None))
        while not job.done.wait(0.005):
            if self._stop is not None and self._should_stop() and job.cancel():
                job.wait()
                raise EvaluationAborted("the batch was not started: stopped")
        job.wait()
        self._ids[self._n:self._n + len(batch)] = np.asarray(batch, dtype=np.intc)
        self._n += len(batch)

    def _should_stop(self) -> bool:
        try:
            return bool(self._stop())
        except Exception:  # as llama.cpp's abort callback: a raising check counts as False
            return False

    def abortable(self, should_stop: Callable[[], bool]) -> ContextManager:
        """Batches not yet started stop (EvaluationAborted, the live sequence as before)."""
        return self._stopping(should_stop)

    @contextmanager
    def _stopping(self, should_stop: Callable[[], bool]) -> Iterator[None]:
        self._stop = should_stop
        try:
            yield
        finally:
            self._stop = None

    def generate(self, tokens: Sequence[int], n_past: int = 0, max_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 0.95, seed: int | None = None) -> Iterator[int]:
        """``EngineAdapter.generate``, the answer decoded in the engine's step loop."""
        check_generation(self, tokens, max_tokens)
        tokens = [int(t) for t in tokens]
        self.kv_epoch += 1
        self._resume(tokens, n_past)
        plan = self.prefill_plan(n_past, len(tokens))
        if self.turn_tokens:
            plan = turn_batches(plan, self.turn_tokens, self.injection_rule)
        for start, end in plan[:-1]:
            self._tokens_left = len(tokens) - start
            with self._turn(len(tokens) - start):
                self._eval_batch(tokens[start:end])
        self._tokens_left = 0
        start, end = plan[-1]
        sampler = self._sampler(temperature, top_p, seed)
        job = Job(self.seq, tokens[start:end], start, sampler, max_tokens, self.is_eog)
        out: list[int] = []
        try:
            with self._turn(len(tokens) - start):
                self.engine.loop.submit(job)
            while (token := job.tokens.get()) is not END:
                out.append(token)
                yield token
            job.wait()
        finally:
            job.cancel()
            job.done.wait()
            self._llama_cpp.llama_sampler_free(sampler)
            self._settle(tokens, start, job, out)

    def _settle(self, tokens: list[int], start: int, job: Job, out: list[int]) -> None:
        """After a generation: the sequence holds what the loop evaluated of the prompt and of the
        tokens the reader took, and nothing after."""
        prompt_done = min(job.evaluated, len(tokens) - start)
        n = start + prompt_done
        if prompt_done == len(tokens) - start:
            n += min(job.evaluated - prompt_done, len(out))
        held = tokens + out
        self._ids[start:n] = np.asarray(held[start:n], dtype=np.intc)
        self._n = n
        self._remove_from(n)

    def _sampler(self, temperature: float, top_p: float, seed: int | None):
        """llama.cpp's sampler chain as ``LlamaCppAdapter`` gets it from llama-cpp-python's
        ``Llama._init_sampler`` (repeat penalty 1 and min-p 0 change nothing, so they are left out):
        greedy at temperature 0, else top-k off, top-p, temperature, then a draw seeded by ``seed``."""
        c = self._llama_cpp
        if seed is not None:
            self._seed = seed
        chain = c.llama_sampler_chain_init(c.llama_sampler_chain_default_params())
        if temperature <= 0:
            c.llama_sampler_chain_add(chain, c.llama_sampler_init_greedy())
            return chain
        for sampler in (c.llama_sampler_init_top_k(0), c.llama_sampler_init_typical(1.0, 1),
                        c.llama_sampler_init_top_p(top_p, 1), c.llama_sampler_init_min_p(0.0, 1),
                        c.llama_sampler_init_temp(temperature), c.llama_sampler_init_dist(self._seed)):
            c.llama_sampler_chain_add(chain, sampler)
        return chain

    def place_kv(self, fragments, chain_tokens, keep, at, tokens) -> None:
        """Refused: :attr:`blend_refusal`."""
        EngineAdapter.place_kv(self, fragments, chain_tokens, keep, at, tokens)

    def recompute(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Refused: :attr:`blend_refusal`."""
        EngineAdapter.recompute(self, tokens, start, end)

    def slot_adapters(self) -> list[EngineAdapter]:
        """Every slot of the engine, by sequence id."""
        return list(self.engine.adapters)

    def perf_counts(self) -> dict:
        """This slot's evaluations since :meth:`reset_perf`: ``n_p_eval`` (tokens in batches of
        several), ``n_eval`` (tokens evaluated alone)."""
        p, one = self.engine.loop.counts.get(self.seq, [0, 0])
        return {"n_p_eval": p - self._perf_base[0], "n_eval": one - self._perf_base[1]}

    def reset_perf(self) -> None:
        self._perf_base = tuple(self.engine.loop.counts.get(self.seq, [0, 0]))

    _perf_base = (0, 0)

    def set_threads(self, n_threads: int) -> None:
        """Every slot's threads (``SlotEngine.set_threads``)."""
        self.engine.set_threads(n_threads)

    def close(self) -> None:
        """Close the whole engine (every slot)."""
        self.engine.close()
