"""llama-cpp-python adapter: KV fragments out of and into a live llama.cpp sequence.

Extraction reads ``llama_state_seq_get_data`` and cuts it (``seqstate``, ``kv_layout``);
injection writes fragments straight into one ``llama_state_seq_set_data`` buffer
(``state_buffer``). Relied on (llama-cpp-python 0.3.36): set_data replaces the sequence and must
cover positions 0..N-1, returning 0 for a buffer it refuses; after injecting N tokens
``Llama.input_ids[:N]`` and ``Llama.n_tokens`` must be set, or ``eval`` drops the cells;
``Llama.reset()`` does not clear KV memory, ``llama_memory_clear`` does.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Mapping, Sequence

import numpy as np

from edgesync_engines.adapters import kv_layout, llamacpp_blend, llamacpp_model, seqstate, state_buffer
from edgesync_engines.adapters.kv_blocks import KVBlock, fragment_blocks
from edgesync_engines.adapters.model_files import (
    ModelLoadError,
    ModelNotFoundError,
    file_fingerprint,
    model_file,
    route_native_logs,
    sigint_held,
)
from edgesync_engines.adapters.protocol import (
    KERNEL_PROBE_TOKENS,
    PROBE_TEXT,
    EngineAdapter,
    EvaluationAborted,
    InjectionError,
    kernel_digest,
)
from edgesync_engines.adapters.threads import usable_cpus
from edgesync_engines.config import KV_TYPES
from edgesync_store.schema import KVFragment, Namespace

log = logging.getLogger(__name__)

ENGINE = "llama.cpp"
LAYOUT = kv_layout.LAYOUT
__all__ = ["ENGINE", "LAYOUT", "DEFAULT_N_CTX", "LlamaCppAdapter"]
DEFAULT_N_CTX = 4096
_PARTIAL_ONLY = 1
"""``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` (``include/llama.h``): the sliding-window part only."""
ROW_PROBE_TEXT = PROBE_TEXT.encode()
"""The text whose first :data:`ROW_PROBE_TOKENS` tokens :meth:`LlamaCppAdapter.probe_rows` evaluates."""
ROW_PROBE_TOKENS = 20
ROW_PROBE_CUTS = (3, 5, 17)
"""Injection points the probe tries: odd offsets in groups of 4 and 8 rows, and a first batch
of two tokens."""
STATE_CHUNK_BYTES = 32 << 20
"""Bytes of seq state a long injection or store-back moves per ``llama_state_seq_*`` call (where
:meth:`LlamaCppAdapter._in_chunks`): a hit or a store-back holds one chunk beside the KV cache,
not a second copy of the context."""
_PROBED_RULES: dict[tuple[bytes, int], kv_layout.InjectionRule] = {}
""":meth:`LlamaCppAdapter.probe_rows`' answers in this process, by namespace digest and block."""
_PROBED_KERNELS: dict[tuple, str] = {}
""":meth:`LlamaCppAdapter.probe_kernels`' answers in this process, by model file and settings."""


class LlamaCppAdapter(EngineAdapter):
    """An ``EngineAdapter`` on one ``llama_cpp.Llama``.

    Args:
        model: a GGUF path, or a ``llama_cpp.Llama`` (its settings used; pass ``model_path``).
        n_ctx: context window in tokens.
        n_threads: CPU threads (default: every usable CPU).
        flash_attn: changes the V layout and the numbers; recorded in the namespace.
        kv_type: one of ``config.KV_TYPES`` (recorded; a quantized V turns flash attention on).
        n_seq_max, kv_unified: the context's sequences and whether they share one KV buffer
            (``llamacpp_slots.SlotEngine`` opens one stream per sequence; ``n_ctx`` is then the total).
        verbose: let llama.cpp's log lines through at WARNING.
        seed: the sampler's seed when ``generate`` is given none.

    Raises ModelNotFoundError (no file), ModelLoadError (llama.cpp cannot load it) or ValueError (bad
    ``kv_type``). A model whose KV cannot be cut is still served, uncached.
    """

    def __init__(
        self,
        model: "str | os.PathLike | object | None" = None,
        n_ctx: int = DEFAULT_N_CTX,
        n_threads: int | None = None,
        flash_attn: bool = False,
        verbose: bool = False,
        seed: int = 0,
        model_path: str | os.PathLike | None = None,
        kv_type: str = "f16",
        n_seq_max: int = llamacpp_blend.N_SEQ_MAX,
        kv_unified: bool = True,
    ) -> None:
        import llama_cpp

        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type: {kv_type!r} is not one of {', '.join(KV_TYPES)}")
        type_kv = seqstate.GGML_TYPE_BY_NAME[kv_type]
        if type_kv.quantized and not flash_attn:
            log.info("kv_type %s: turning flash attention on (llama.cpp needs it for a quantized V)", kv_type)
            flash_attn = True
        route_native_logs(verbose)
        if n_threads and n_threads > usable_cpus():
            # llama.cpp's threads wait for one another at every graph node: more threads than
            # CPUs leave some waiting for a core at each barrier
            log.warning("n_threads %d is more than the %d CPUs this process may run on: every evaluation slows "
                        "down; use at most %d", n_threads, usable_cpus(), usable_cpus())
        self._llama_cpp = llama_cpp
        self._seed = seed
        self.lock = threading.RLock()
        if model is None or isinstance(model, (str, os.PathLike)):
            path = model_file(model)
            try:
                with llamacpp_blend.sequence_params(llama_cpp, kv_unified, n_seq_max), sigint_held():
                    self.llm = llama_cpp.Llama(
                        model_path=str(path),
                        n_ctx=n_ctx,
                        n_threads=n_threads or usable_cpus(),
                        n_threads_batch=n_threads or usable_cpus(),
                        flash_attn=flash_attn,
                        verbose=verbose,
                        seed=seed,
                        type_k=type_kv.code,
                        type_v=type_kv.code,
                        swa_full=True,
                    )
            except ValueError as exc:  # llama-cpp-python's "Failed to load model / create context"
                problem = llamacpp_model.gguf_problem(path)
                raise ModelLoadError(f"{path}: {problem}" if problem else f"{path}: {exc} (n_ctx={n_ctx})") from None
            self.model_path = path
            self._owns_llm = True
        else:
            self._owns_llm = False
            self.llm = model
            self.model_path = Path(model_path or getattr(model, "model_path", ""))
            if not self.model_path.is_file():
                raise ModelNotFoundError("pass model_path= for a Llama object so its file can be fingerprinted")
        # llama.cpp rounds the context up (to 256 cells), but llama-cpp-python sizes its token
        # buffer (input_ids) to the n_ctx asked for: a prompt fits only the smaller of the two
        self.n_ctx = min(int(self.llm.n_ctx()), len(self.llm.input_ids))
        self.flash_attn = bool(flash_attn) if self._owns_llm else (
            self.llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        )
        self._ctx = self.llm.ctx
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        if not self._mem or not llama_cpp.llama_model_has_decoder(self.llm.model):
            self.close()
            raise ModelLoadError(f"{self.model_path}: no decoder KV memory (an embedding or encoder-only model)")
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._swa = kv_layout.SwaCapture()
        self._state_buf: np.ndarray | None = None  # the largest injected state so far (uint8)
        self._probe()

    @property
    def closed(self) -> bool:
        return self.llm is None

    def copy_probe_to(self, other: "LlamaCppAdapter") -> None:
        """Give ``other`` (an adapter on another sequence of this context, made without its own
        ``__init__``) this adapter's model, context and probed KV layout; it does not own them."""
        for name in ("llm", "_llama_cpp", "_ctx", "_mem", "_vocab", "namespace", "_layout", "cache_refusal",
                     "injection_rule", "flash_attn", "model_path", "_seed"):
            setattr(other, name, getattr(self, name))
        other._owns_llm = False
        other._swa = kv_layout.SwaCapture()

    # -- set-up ---------------------------------------------------------------------------

    seq = llamacpp_blend.MAIN_SEQ
    """The llama.cpp sequence this adapter answers from."""

    def _probe(self) -> None:
        """Learn the KV layout from a two-cell seq state, or set :attr:`cache_refusal` (namespace None)."""
        self.namespace = None
        self._layout: kv_layout.StateLayout | None = None
        self.cache_refusal = llamacpp_model.memory_refusal(self._llama_cpp, self.llm, KV_TYPES)
        if self.cache_refusal is None:
            self.clear_kv_cache()
            try:
                # two cells, so a 2D cell position (M-RoPE) shows in the second one
                self.llm.eval([self.llm.token_eos()] * 2)
                model = self.llm.model
                self._layout = kv_layout.probe_layout(
                    self._get_state(), int(self._llama_cpp.llama_model_n_layer(model)),
                    int(self._llama_cpp.llama_model_n_swa(model)), lambda ext: self._swa_part_now(ext)[0])
                self.namespace = self._probed_namespace(self._layout)
            except ValueError as exc:  # SeqStateError, or a geometry Namespace refuses
                self._layout = None
                self.cache_refusal = f"seq state not understood: {exc}"
            finally:
                self.clear_kv_cache()
        if self.cache_refusal is not None:
            log.warning("%s: serving uncached (no KV reuse): %s", self.model_path.name, self.cache_refusal)
        else:
            log.debug("llama.cpp KV layout: %s", self.namespace)
        if self.cache_refusal is None:
            key = (self.namespace.digest(), self._block_tokens())
            if key not in _PROBED_RULES:
                _PROBED_RULES[key] = self._flash_rule(self.probe_rows())
            self.injection_rule = _PROBED_RULES[key]
            self.cache_refusal = self._flash_refusal()
            if self.cache_refusal is not None:
                self.namespace = None
                log.warning("%s: serving uncached (no KV reuse): %s", self.model_path.name, self.cache_refusal)
        self.blend_refusal = self.cache_refusal or self._layout.blend_refusal() or (
            None if self.llm.context_params.n_seq_max >= 2 and self.llm.context_params.kv_unified
            else "the Llama was opened with one sequence (blending needs n_seq_max >= 2, kv_unified)")
        self._scratch = llamacpp_blend.ScratchSequence(self._llama_cpp, self._ctx, self._mem, self.llm.n_batch,
                                                       self.blend_refusal)

    def probe_rows(self) -> kv_layout.InjectionRule:
        """The injection rule this model's kernels allow: :data:`kv_layout.ANY_ROW` when a
        prompt cut at each of :data:`ROW_PROBE_CUTS` and evaluated on gives its uncached
        prefill's seq state and last logits bit for bit, else :data:`kv_layout.GROUPED_ROWS`
        (also when the probe cannot run). The KV memory is empty after."""
        tokens = self.llm.tokenize(ROW_PROBE_TEXT, add_bos=True)[:ROW_PROBE_TOKENS]
        n, block = len(tokens), self._block_tokens()
        if n < ROW_PROBE_TOKENS:
            return kv_layout.GROUPED_ROWS
        try:
            self.clear_kv_cache()
            reference = self._probe_eval(tokens, 0, block)
            for cut in ROW_PROBE_CUTS:
                self.clear_kv_cache()
                self.llm.eval(list(tokens[:cut]))
                if self._probe_eval(tokens, cut, block) != reference:
                    log.debug("injection rule: rows computed by groups (cut at %d of %d differs)", cut, n)
                    return kv_layout.GROUPED_ROWS
        except (RuntimeError, ValueError) as exc:
            log.debug("injection rule probe failed: %s", exc)
            return kv_layout.GROUPED_ROWS
        finally:
            self.clear_kv_cache()
        log.debug("injection rule: every row alike (any point, first batches of 2 or more)")
        return kv_layout.ANY_ROW

    def probe_kernels(self) -> str:
        """The kernel digest of this build on this machine (``Namespace.kernels``,
        :func:`protocol.kernel_digest`): of the logits its kernels compute for the first
        :data:`KERNEL_PROBE_TOKENS` tokens of :data:`ROW_PROBE_TEXT` in one prefill batch (batches
        of ``n_batch`` when smaller), then for the next token alone. llama.cpp's NEON and AVX2
        kernels, or its AVX-512 and AVX2 ones, give other bits, so KV from another kernel set
        falls in another namespace: a miss, not an exact hit (docs/guarantees.md). Independent of
        the thread count and context size. Clears the KV memory, before and after. Raises
        RuntimeError or ValueError when the probe text does not evaluate."""
        tokens = self.llm.tokenize(ROW_PROBE_TEXT, add_bos=True)[:KERNEL_PROBE_TOKENS + 1]
        rows = []
        self.clear_kv_cache()
        try:
            for batch in (tokens[:-1], tokens[-1:]):
                self.llm.eval(list(batch))
                logits = self._llama_cpp.llama_get_logits_ith(self._ctx, -1)
                rows.append(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).copy())
        finally:
            self.clear_kv_cache()
        return kernel_digest(rows)

    def _flash_rule(self, rule: kv_layout.InjectionRule) -> kv_layout.InjectionRule:
        """``rule`` (the matrix kernels' rows, :meth:`probe_rows`: its batches are shorter than a
        flash-attention tile) with flash attention's batches of a tile or more when it is on over
        f16 or f32 KV (:func:`kv_layout.tiled_rule`); quantized KV takes its per-row path at
        every batch size."""
        if self.flash_attn and not seqstate.ggml_type(self._layout.type_kv).quantized:
            return kv_layout.tiled_rule(rule)
        return rule

    def _flash_refusal(self) -> str | None:
        """Why flash attention's rule cannot hold on this block grid (None: it can)."""
        rule, block = self.injection_rule, self._block_tokens()
        if rule.min_batch and (block < 2 * rule.min_batch + rule.row_group or block % rule.row_group):
            return (f"flash attention needs prefill batches of {rule.min_batch}+ tokens: a block of "
                    f"{2 * rule.min_batch + rule.row_group}+ tokens on a multiple of {rule.row_group} "
                    f"(n_batch or the window), got {block}")
        return None

    def _probe_eval(self, tokens: Sequence[int], start: int, block: int) -> tuple[bytes, bytes]:
        """Evaluate ``tokens[start:]`` in prefill batches: the seq state and last logits (float32 bytes)."""
        for a, b in kv_layout.prefill_blocks(start, len(tokens), block):
            self.llm.eval(list(tokens[a:b]))
        logits = self._llama_cpp.llama_get_logits_ith(self._ctx, -1)
        return bytes(self._get_state()), np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).tobytes()

    def _probed_namespace(self, layout: kv_layout.StateLayout) -> Namespace:
        """The namespace of a probed layout (``StateLayout.namespace``), with the kernel digest
        (:meth:`probe_kernels`, once per model and settings in a process). The KV memory is
        empty after."""
        c, fingerprint = self._llama_cpp, file_fingerprint(self.model_path)
        key = (fingerprint, self.flash_attn, layout.type_kv, min(int(self.llm.n_batch), KERNEL_PROBE_TOKENS))
        if key not in _PROBED_KERNELS:
            _PROBED_KERNELS[key] = self.probe_kernels()
        return layout.namespace(
            int(c.llama_model_n_head_kv(self.llm.model)), model_fingerprint=fingerprint,
            engine=ENGINE, engine_version=f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}",
            flash_attn=self.flash_attn, kernels=_PROBED_KERNELS[key])

    def _get_state(self, flags: int = 0, seq: int | None = None) -> memoryview:
        """The state bytes of the sequence (``seq``: another one); ``flags`` :data:`_PARTIAL_ONLY`
        reads the window part alone."""
        llama_cpp, seq = self._llama_cpp, self.seq if seq is None else seq
        size = llama_cpp.llama_state_seq_get_size_ext(self._ctx, seq, flags)
        buf = np.empty(size, np.uint8)
        written = llama_cpp.llama_state_seq_get_data_ext(self._ctx, (ctypes.c_uint8 * size).from_buffer(buf), size,
                                                         seq, flags)
        if written != size:
            raise seqstate.SeqStateError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return memoryview(buf)

    def _in_chunks(self) -> bool:
        """Whether long states move in chunks of cells through the scratch sequence: a text-only
        cache of one part, on a context whose scratch sequence shares the main one's cells."""
        return self._layout is not None and len(self._layout.part_layers) == 1 and self.blend_refusal is None

    def _chunk_cells(self) -> int:
        """Cells of one chunk: :data:`STATE_CHUNK_BYTES` of seq state, a multiple of 256, at least 256."""
        cell = state_buffer.state_bytes(self._layout, 2) - state_buffer.state_bytes(self._layout, 1)
        return max(1, STATE_CHUNK_BYTES // cell // 256) * 256

    def _range_state(self, start: int, end: int) -> memoryview:
        """The state of the live cells at positions ``[start, end)`` alone: tagged into the
        scratch sequence (no copy in a unified cache), read, untagged."""
        c, scratch = self._llama_cpp, llamacpp_blend.SCRATCH_SEQ
        c.llama_memory_seq_rm(self._mem, scratch, -1, -1)
        c.llama_memory_seq_cp(self._mem, self.seq, scratch, start, end)
        try:
            return self._get_state(seq=scratch)
        finally:
            c.llama_memory_seq_rm(self._mem, scratch, -1, -1)

    def _swa_part_now(self, ext_bytes: int | None = None) -> list[seqstate.CachePart]:
        """The live sliding-window part alone (a list of one part)."""
        ext = (seqstate.CELL_EXT_BYTES if self._layout.cell_ext else 0) if ext_bytes is None else ext_bytes
        return seqstate.parse_parts(self._get_state(_PARTIAL_ONLY), ext)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (invalid UTF-8 replaced)."""
        return self.llm.detokenize(list(tokens)).decode("utf-8", "replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """``EngineAdapter``'s, or for a GGUF without ``tokenizer.chat_template``, llama.cpp's
        built-in template of its architecture (ValueError: none at all, or a bad message)."""
        name = None
        if not self.llm.metadata.get("tokenizer.chat_template"):
            name = llamacpp_model.builtin_template_for(self._llama_cpp, self.llm.metadata.get("general.architecture"))
        if name is None:
            # raises when there is no template at all
            return super().apply_chat_template(messages, add_generation_prompt)
        return llamacpp_model.builtin_chat_prompt(self._llama_cpp, name, messages, self.model_path.name,
                                                  add_generation_prompt)

    def _chat_template(self) -> tuple[str, str, str]:
        template = self.llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{self.model_path.name}: the GGUF has no tokenizer.chat_template")
        bos = self.detokenize([self.llm.token_bos()]) if self.llm.token_bos() >= 0 else ""
        return template, self.detokenize([self.llm.token_eos()]), bos

    # -- the live sequence ------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        return self.llm.n_tokens

    def _live_tokens(self, end: int) -> np.ndarray:
        return np.asarray(self.llm.input_ids[:end])

    def _truncate(self, n: int) -> None:
        # Llama.eval removes the cells from position n_tokens on before it decodes
        self.llm.n_tokens = n
        self._swa.truncate(n)

    def _span_kv(self, spans: Sequence[tuple[int, int]], layers: range, head_start: int,
                 head_end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """One seq-state read cut per span by ``StateLayout.span_kv`` (errors there)."""
        layout = self._layout
        if self._in_chunks():  # the spans' cells alone, not the whole context
            state = self._range_state(min(s for s, _ in spans), max(e for _, e in spans))
        else:
            state = self._get_state()
        parts = seqstate.parse_parts(state, seqstate.CELL_EXT_BYTES if layout.cell_ext else 0)
        cols = slice(head_start * self.namespace.head_width, head_end * self.namespace.head_width)
        return layout.span_kv(parts, self._swa, spans, self._live_tokens(self.n_tokens), layers, cols)

    def stage_fragment(self, fragment: KVFragment) -> KVFragment:
        """A fragment of this namespace with V laid out as the seq state holds it."""
        return state_buffer.stage(self._layout, fragment) if fragment.namespace == self.namespace else fragment

    def warm_up(self, n_tokens: int = 0, any_hit: bool = False) -> None:
        """``EngineAdapter.warm_up``, then :meth:`make_room` for ``n_tokens`` cells, or with
        ``any_hit`` where long states move in chunks (:meth:`_in_chunks`) for a whole chunk:
        fresh pages fault in at several microseconds each, and the first hit of any size then
        finds them touched."""
        super().warm_up(n_tokens)
        self.reset_perf()
        chunk = min(self.n_ctx, self._chunk_cells()) if any_hit and self._in_chunks() else 0
        self.make_room(max(n_tokens, chunk))

    def make_room(self, n_tokens: int, should_stop: Callable[[], bool] | None = None) -> bool:
        """The seq-state buffer injections reuse, grown to ``n_tokens`` cells (at most the
        context) and faulted in now (``state_buffer.room``); not for sliding-window caches,
        whose capture keeps views of each injected buffer."""
        if n_tokens < 1 or self._layout.swa_part is not None:
            return True
        n = min(n_tokens, self.n_ctx, self._chunk_cells() if self._in_chunks() else n_tokens)
        self._state_buf = state_buffer.room(self._layout, n, self._state_buf, should_stop)
        return self._state_buf is not None and len(self._state_buf) >= state_buffer.state_bytes(self._layout, n)

    def _load_blocks(self, blocks: Sequence[KVBlock], n_tokens: int, tokens: Sequence[int],
                     on_chunk: Callable[[], None] | None = None) -> None:
        """Set the seq state from one buffer, or chunk by chunk (:meth:`_in_chunks`) when longer
        than one; InjectionError when refused (the sequence is cleared)."""
        if self._in_chunks() and n_tokens > self._chunk_cells():
            self._load_chunks(blocks, n_tokens, tokens, on_chunk)
            return
        layout, size = self._layout, state_buffer.state_bytes(self._layout, n_tokens)
        # one buffer reused from injection to injection, but where the capture keeps views of it
        out = state_buffer.room(layout, n_tokens, self._state_buf) if layout.swa_part is None else None
        buf, views = state_buffer.build(layout, self.namespace.head_width, blocks, n_tokens, tokens, self.seq, out)
        self._state_buf = buf if layout.swa_part is None else None
        read = self._set_state(buf, size)
        if read != size:
            self.clear_kv_cache()
            raise InjectionError(f"llama_state_seq_set_data read {read} of {size} bytes")
        self._hold(tokens, n_tokens)
        if layout.swa_part is not None:
            self._swa.seed(*views[layout.swa_part])  # views of buf: the capture keeps it alive

    def _load_chunks(self, blocks: Sequence[KVBlock], n_tokens: int, tokens: Sequence[int],
                     on_chunk: Callable[[], None] | None) -> None:
        """Positions ``0..n_tokens-1`` a chunk of cells at a time: each restored into the scratch
        sequence and tagged into this one (``ScratchSequence.append``), through one reused buffer
        of :meth:`_chunk_cells` cells, ``on_chunk`` called after each. InjectionError when refused
        (the sequence is cleared)."""
        per = self._chunk_cells()
        self._state_buf = state_buffer.room(self._layout, per, self._state_buf)
        self._llama_cpp.llama_memory_seq_rm(self._mem, self.seq, -1, -1)
        for start in range(0, n_tokens, per):
            end = min(n_tokens, start + per)
            buf, _ = state_buffer.build(self._layout, self.namespace.head_width, blocks, end, tokens,
                                        llamacpp_blend.SCRATCH_SEQ, self._state_buf, start)
            try:
                self._scratch.append(buf, state_buffer.state_bytes(self._layout, end - start), start, end)
            except InjectionError:
                self.clear_kv_cache()
                raise
            if on_chunk is not None:
                on_chunk()
        self._hold(tokens, n_tokens)

    def _set_state(self, buf: np.ndarray, size: int) -> int:
        """``llama_state_seq_set_data`` of ``buf[:size]`` (uint8) into the sequence; the bytes read."""
        return self._llama_cpp.llama_state_seq_set_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(buf), size,
                                                        self.seq)

    def _hold(self, tokens: Sequence[int], n_tokens: int) -> None:
        """The live sequence now holds ``tokens[:n_tokens]`` (its KV already set)."""
        self.llm.input_ids[:n_tokens] = np.asarray(tokens[:n_tokens], dtype=self.llm.input_ids.dtype)
        self.llm.n_tokens = n_tokens

    def place_kv(self, fragments: Sequence[KVFragment], chain_tokens: Sequence[int], keep: tuple[int, int], at: int,
                 tokens: Sequence[int]) -> None:
        """Through ``ScratchSequence.place``."""
        start, end = keep
        self.kv_epoch += 1
        if list(chain_tokens[start:end]) != list(tokens[at:at + end - start]):
            raise ValueError(f"place_kv: the kept chain tokens differ from the prompt's at {at}")
        blocks = fragment_blocks(self.namespace, fragments, end, chain_tokens)
        buf, _ = state_buffer.build(self._layout, self.namespace.head_width, blocks, end, chain_tokens,
                                    llamacpp_blend.SCRATCH_SEQ)
        self._scratch.place(buf, end, start, end, at)
        self._mark_live(tokens, at, at + end - start)

    def recompute(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Through ``ScratchSequence.recompute``."""
        self.kv_epoch += 1
        self._scratch.recompute(tokens, start, end)
        self._mark_live(tokens, start, end)

    def _mark_live(self, tokens: Sequence[int], start: int, end: int) -> None:
        self.llm.input_ids[start:end] = np.asarray(tokens[start:end], dtype=self.llm.input_ids.dtype)
        self.llm.n_tokens = max(self.llm.n_tokens, end)

    def usable_prefix(self, available: int, n_prompt: int) -> int:
        """:func:`kv_layout.usable_prefix` on this adapter's block grid."""
        return kv_layout.usable_prefix(available, n_prompt, self._block_tokens(), self.injection_rule)

    def prefill_batches(self, n_past: int, end: int, batch_tokens: int) -> list[tuple[int, int]]:
        """:func:`kv_layout.exact_batches` on this adapter's block grid."""
        return kv_layout.exact_batches(n_past, end, self._block_tokens(), batch_tokens, self.injection_rule)

    def prefill_plan(self, n_past: int, n_prompt: int) -> list[tuple[int, int]]:
        """:func:`kv_layout.prefill_blocks` on this adapter's block grid and injection rule."""
        return kv_layout.prefill_blocks(n_past, n_prompt, self._block_tokens(), self.injection_rule)

    def _block_tokens(self) -> int:
        """The prefill's block grid: ``n_batch`` (or ``n_ubatch``, the most ``llama_decode``
        evaluates at once, when smaller), or the window when it is shorter."""
        n_batch = min(int(self.llm.n_batch), int(self._llama_cpp.llama_n_ubatch(self._ctx)))
        if self._layout is not None and self._layout.swa_part is not None:
            n_batch = min(n_batch, self._layout.n_swa)
        return n_batch

    def is_eog(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def _eval_batch(self, batch: Sequence[int]) -> None:
        self._evaluate(batch)
        if self._layout is not None and self._layout.swa_part is not None:
            n = self.n_tokens
            try:
                self._swa.add(self._swa_part_now()[0], n - len(batch), n)
            except seqstate.SeqStateError as exc:
                # the prompt is still answered; its sliding-window KV is just not storable
                log.warning("sliding-window KV not captured: %s", exc)

    def _evaluate(self, batch: Sequence[int]) -> None:
        """Evaluate ``batch`` after the live sequence, which then holds it."""
        self.llm.eval(list(batch))

    def _sampled_tokens(self, temperature: float, top_p: float, seed: int | None) -> Iterator[int]:
        """llama-cpp-python's sampler on the live sequence: greedy (top-k 40 at temperature
        0) or top-p with top-k off; no min-p and no repeat penalty."""
        if seed is not None:
            self.llm.set_seed(seed)
        return self.llm.generate(
            [], reset=False, temp=temperature, top_p=top_p, top_k=0 if temperature > 0 else 40,
            min_p=0.0, repeat_penalty=1.0,
        )

    def token_bytes(self, token: int) -> bytes:
        return self.llm.detokenize([token])

    def perf_counts(self) -> dict:
        """llama.cpp's counters since the last reset (0 reads as 1): ``n_p_eval`` (tokens in
        multi-token batches), ``n_eval`` (one-token evaluations)."""
        data = self._llama_cpp.llama_perf_context(self._ctx)
        return {"n_p_eval": int(data.n_p_eval), "n_eval": int(data.n_eval)}

    def reset_perf(self) -> None:
        """Zero llama.cpp's perf counters once the queued evaluations are settled."""
        self._llama_cpp.llama_synchronize(self._ctx)
        self._llama_cpp.llama_perf_context_reset(self._ctx)

    def abortable(self, should_stop: Callable[[], bool]) -> ContextManager:
        """Through llama.cpp's abort callback (called between a batch's graph nodes): an
        aborted ``llama_decode`` removes the batch's cells and ``Llama.eval`` has not counted
        them, so the live sequence is what it was. A ``should_stop`` that raises counts as
        False."""
        return self._abort_callback(should_stop)

    @contextmanager
    def _abort_callback(self, should_stop: Callable[[], bool]) -> Iterator[None]:
        fired = False

        def check(_data) -> bool:
            nonlocal fired
            try:
                fired = fired or bool(should_stop())
            except Exception:  # never propagate into C; the batch runs on
                return False
            return fired

        callback = self._llama_cpp.ggml_abort_callback(check)  # kept alive until it is unset
        self._llama_cpp.llama_set_abort_callback(self._ctx, callback, None)
        try:
            yield
        except RuntimeError as exc:
            if fired and not isinstance(exc, EvaluationAborted):
                raise EvaluationAborted(f"evaluation stopped midway: {exc}") from None
            raise
        finally:
            self._llama_cpp.llama_set_abort_callback(self._ctx, self._llama_cpp.ggml_abort_callback(), None)

    def set_threads(self, n_threads: int) -> None:
        """``llama_set_n_threads`` for single-token and batch evaluation alike (ValueError below 1)."""
        super().set_threads(n_threads)
        self._llama_cpp.llama_set_n_threads(self._ctx, n_threads, n_threads)

    def clear_kv_cache(self) -> None:
        """Empty the KV memory (``llama_memory_clear(mem, True)``) and forget the tokens."""
        self.kv_epoch += 1
        self._llama_cpp.llama_memory_clear(self._mem, True)
        self.llm.n_tokens = 0
        self._swa.clear()

    def close(self) -> None:
        """Free the model and context if this adapter loaded them (a ``Llama`` passed in stays open)."""
        with self.lock:
            llm, self.llm = getattr(self, "llm", None), None
            if llm is not None and self._owns_llm:
                llm.close()
