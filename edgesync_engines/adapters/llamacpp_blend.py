"""Placing stored KV at another position of a llama.cpp sequence, and recomputing runs of it
(``request/blend.py``), with llama.cpp's own calls on a context of two sequences in one unified
cache (:func:`sequence_params`):

* :meth:`ScratchSequence.place`: restore a stored chain into the scratch sequence at 0..M-1
  (``llama_state_seq_set_data``), shift the kept range to its new position
  (``llama_memory_seq_add``: llama.cpp re-rotates K on the next decode), tag those cells into
  sequence 0 (``llama_memory_seq_cp``, no copy in a unified cache), drop the scratch tags.
* :meth:`ScratchSequence.recompute`: tag sequence 0's cells before ``a`` into the scratch
  sequence, decode ``[a, b)`` there, and let the new cells replace sequence 0's ``[a, b)``.

Relied on (``src/llama-batch.cpp``, ``src/llama-kv-cache.cpp``): a sequence's batch starts
right after its highest cached position; a token attends only to cells of its own sequence at
positions not after its own; ``state_read`` finds free cells anywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading

import numpy as np

from edgesync_engines.adapters.protocol import InjectionError

log = logging.getLogger(__name__)

MAIN_SEQ = 0
"""The sequence the adapter answers from."""
SCRATCH_SEQ = 1
"""The sequence stored KV is restored and recomputed in before it joins :data:`MAIN_SEQ`."""
N_SEQ_MAX = 2

_PARAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def sequence_params(llama_cpp_module, kv_unified: bool = True, n_seq_max: int = N_SEQ_MAX):
    """While open, ``llama_context_default_params()`` returns ``n_seq_max`` and ``kv_unified``
    as given: ``Llama.__init__`` sets these two fields only in embedding mode, so this is how a
    generating context gets more sequences. Serialized: the module attribute is shared."""
    low = llama_cpp_module.llama_cpp
    with _PARAMS_LOCK:
        original = low.llama_context_default_params

        def params():
            p = original()
            p.n_seq_max = n_seq_max
            p.kv_unified = kv_unified
            return p

        low.llama_context_default_params = params
        try:
            yield
        finally:
            low.llama_context_default_params = original


class ScratchSequence:
    """The scratch-sequence operations on one context (the caller holds the adapter's lock).
    ``n_batch``: the largest batch ``llama_decode`` takes (tokens); ``refusal``: why this context
    cannot blend (None: it can), raised as :class:`InjectionError` by every operation."""

    def __init__(self, llama_cpp_module, ctx, mem, n_batch: int, refusal: str | None) -> None:
        self._c = llama_cpp_module
        self._ctx = ctx
        self._mem = mem
        self._n_batch = int(n_batch)
        self.refusal = refusal

    def place(self, state: bytearray, n_cells: int, keep_start: int, keep_end: int, at: int) -> None:
        """Place cells ``[keep_start, keep_end)`` of ``state`` (a ``state_buffer.build`` buffer
        of ``n_cells`` cells) at ``at`` in the main sequence. Raises InjectionError when llama.cpp
        refuses the buffer (scratch cleared, main sequence unchanged)."""
        if self.refusal is not None:
            raise InjectionError(self.refusal)
        c, mem = self._c, self._mem
        arr = (ctypes.c_uint8 * len(state)).from_buffer(state)
        read = c.llama_state_seq_set_data(self._ctx, arr, len(state), SCRATCH_SEQ)
        if read != len(state):
            c.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)
            raise InjectionError(f"llama_state_seq_set_data (scratch) read {read} of {len(state)} bytes")
        delta = at - keep_start
        if delta:
            c.llama_memory_seq_add(mem, SCRATCH_SEQ, 0, n_cells, delta)
        c.llama_memory_seq_cp(mem, SCRATCH_SEQ, MAIN_SEQ, at, at + keep_end - keep_start)
        c.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)

    def append(self, state: np.ndarray, size: int, start: int, end: int) -> None:
        """Add cells ``[start, end)`` from ``state[:size]`` (a ``state_buffer.build`` buffer of
        those positions) to the main sequence, which holds none of them: restored into the scratch
        sequence, tagged into the main one. Raises InjectionError when llama.cpp refuses the buffer
        (scratch cleared)."""
        if self.refusal is not None:
            raise InjectionError(self.refusal)
        c, mem = self._c, self._mem
        read = c.llama_state_seq_set_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(state), size, SCRATCH_SEQ)
        if read != size:
            c.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)
            raise InjectionError(f"llama_state_seq_set_data (scratch) read {read} of {size} bytes")
        c.llama_memory_seq_cp(mem, SCRATCH_SEQ, MAIN_SEQ, start, end)
        c.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)

    def recompute(self, tokens, a: int, b: int) -> None:
        """Recompute ``tokens[a:b]`` (module docstring); the main sequence must hold position
        ``a - 1`` when ``a > 0``. Raises InjectionError when ``llama_decode`` fails (scratch
        cleared; the main sequence keeps its old cells of ``[a, b)``)."""
        if self.refusal is not None:
            raise InjectionError(self.refusal)
        c, mem = self._c, self._mem
        c.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)
        if a:
            c.llama_memory_seq_cp(mem, MAIN_SEQ, SCRATCH_SEQ, 0, a)
        try:
            for start in range(a, b, self._n_batch):
                self._decode(tokens, start, min(b, start + self._n_batch))
        except InjectionError:
            c.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)
            raise
        c.llama_memory_seq_rm(mem, MAIN_SEQ, a, b)
        c.llama_memory_seq_cp(mem, SCRATCH_SEQ, MAIN_SEQ, a, b)
        c.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)

    def _decode(self, tokens, start: int, end: int) -> None:
        """One ``llama_decode`` of ``tokens[start:end]`` in the scratch sequence, no logits."""
        c = self._c
        n = end - start
        batch = c.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i in range(n):
                batch.token[i] = int(tokens[start + i])
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = SCRATCH_SEQ
                batch.logits[i] = 0
            rc = c.llama_decode(self._ctx, batch)
        finally:
            c.llama_batch_free(batch)
        if rc != 0:
            raise InjectionError(f"llama_decode of a recomputed run [{start}, {end}) returned {rc}")
