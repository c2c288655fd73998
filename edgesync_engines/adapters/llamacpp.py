"""llama-cpp-python adapter: KV fragments out of and into a live llama.cpp sequence.

Extraction reads the sequence with ``llama_state_seq_get_data`` and cuts it with
``seqstate.parse``; injection assembles fragments into one ``llama_state_seq_set_data`` buffer
(``seqstate.serialize``). Facts this relies on (../shared/DESIGN.md 2.2, measured on llama-cpp-python
0.3.36): set_data replaces the destination sequence and must cover positions 0..N-1; after
injecting N tokens, ``Llama.input_ids[:N]`` and ``Llama.n_tokens`` must be set, or ``eval`` drops
the injected cells or writes the suffix at position 0; ``Llama.reset()`` does not clear KV
memory, ``llama_memory_clear`` does; set_data returns 0 for a buffer it refuses.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import threading
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from edgesync_engines.adapters import seqstate
from edgesync_engines.adapters.base import EngineAdapterBase
from edgesync_engines.adapters.model_files import (
    ModelLoadError,
    ModelNotFoundError,
    default_model_path,
    file_fingerprint,
    route_native_logs,
)
from edgesync_engines.adapters.protocol import InjectionError
from edgesync_store.schema import Namespace

log = logging.getLogger(__name__)

ENGINE = "llama.cpp"
LAYOUT = "llama.cpp-seq-state/tokens-major-v1"
"""Name of the fragment tensor layout this adapter writes: per layer [tokens, heads*head_dim]."""
DEFAULT_N_CTX = 4096
_SEQ = 0
"""The one llama.cpp sequence an adapter uses."""
_GGML_TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16"}
"""ggml_type codes of ``ggml.h`` that llama.cpp accepts as ``type_k``/``type_v``, by name."""


class LlamaCppAdapter(EngineAdapterBase):
    """A :class:`~edgesync_engines.adapters.protocol.EngineAdapter` on one ``llama_cpp.Llama``.

    Args:
        model: a GGUF path, or an existing ``llama_cpp.Llama`` (its settings are then used;
            pass ``model_path`` so the namespace can fingerprint the file).
        n_ctx: context window in tokens (default 4,096).
        n_threads: CPU threads (default: all cores).
        flash_attn: flash attention on (changes the V layout and the numbers; recorded in the
            namespace).
        verbose: let llama.cpp's log lines through at WARNING (``model_files.route_native_logs``).
        seed: the sampler's seed when ``generate`` is given none.
        model_path: the GGUF file of a ``Llama`` passed as ``model``.

    Raises:
        ModelNotFoundError: the model file is missing.
        ModelLoadError: llama.cpp cannot load the file or create the context.

    A model whose KV cannot be cut (see :meth:`_probe`) is still served, uncached:
    ``cache_refusal`` then holds the reason and ``namespace`` is None.
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
    ) -> None:
        import llama_cpp

        route_native_logs(verbose)
        self._llama_cpp = llama_cpp
        self.lock = threading.RLock()
        if model is None or isinstance(model, (str, os.PathLike)):
            path = Path(model) if model is not None else default_model_path()
            if not path.is_file():
                raise ModelNotFoundError(f"{path}: no such model file")
            try:
                self.llm = llama_cpp.Llama(
                    model_path=str(path),
                    n_ctx=n_ctx,
                    n_threads=n_threads or os.cpu_count() or 1,
                    n_threads_batch=n_threads or os.cpu_count() or 1,
                    flash_attn=flash_attn,
                    verbose=verbose,
                    seed=seed,
                )
            except ValueError as exc:  # llama-cpp-python's "Failed to load model / create context"
                raise ModelLoadError(f"{path}: {exc} (n_ctx={n_ctx})") from None
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
        self.flash_attn = bool(flash_attn) if model is None or isinstance(model, (str, os.PathLike)) else (
            self.llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        )
        self._ctx = self.llm.ctx
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._probe()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self.llm is None

    # -- set-up ---------------------------------------------------------------------------

    def _probe(self) -> None:
        """Learn the KV layout and geometry from a one-token seq state, or refuse the cache.

        A model or context whose KV this code cannot cut (recurrent or hybrid memory, a
        sliding-window cache, quantized K/V, a seq state it does not parse) sets
        :attr:`cache_refusal` to the reason, logs it once as a warning, and leaves
        :attr:`namespace` None: the engine still answers, uncached."""
        self.namespace = None
        self.cache_refusal = self._unsupported_memory()
        if self.cache_refusal is None:
            self.clear_kv_cache()
            try:
                self.llm.eval([self.llm.token_eos()])
                self.namespace = self._probed_namespace(seqstate.parse(self._get_state()))
            except ValueError as exc:  # SeqStateError, or a geometry Namespace refuses
                self.cache_refusal = f"seq state not understood: {exc}"
            finally:
                self.clear_kv_cache()
        if self.cache_refusal is not None:
            log.warning("%s: serving uncached (no KV reuse): %s", self.model_path.name, self.cache_refusal)
        else:
            log.debug("llama.cpp KV layout: %s", self.namespace)

    def _unsupported_memory(self) -> str | None:
        """Why this model's KV memory cannot be cut into fragments, from the model and context
        settings alone (None: try the probe)."""
        llama_cpp, model = self._llama_cpp, self.llm.model
        arch = self.llm.metadata.get("general.architecture", "?")
        if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
            return f"{arch}: recurrent or hybrid memory holds no per-token KV to cut"
        n_swa = int(llama_cpp.llama_model_n_swa(model))
        if n_swa > 0:
            return (f"{arch}: sliding-window attention (window {n_swa} tokens) keeps a two-part KV cache "
                    "(global + sliding-window layers) that the seq-state codec does not cut yet")
        types = (int(self.llm.context_params.type_k), int(self.llm.context_params.type_v))
        if any(t not in seqstate.DTYPE_NAMES for t in types):
            names = [_GGML_TYPE_NAMES.get(t, f"ggml type {t}") for t in types]
            return f"quantized KV (type_k {names[0]}, type_v {names[1]}): only f16 and f32 KV are cut"
        return None

    def _probed_namespace(self, state: seqstate.SeqState) -> Namespace:
        """The namespace of a parsed one-token seq state (sets the K/V type and V layout).

        Raises:
            seqstate.SeqStateError: layers, types or widths that disagree with the model.
        """
        llama_cpp = self._llama_cpp
        n_layer = int(llama_cpp.llama_model_n_layer(self.llm.model))
        n_head_kv = int(llama_cpp.llama_model_n_head_kv(self.llm.model))
        if state.n_layer != n_layer:
            raise seqstate.SeqStateError(f"probe: seq state has {state.n_layer} layers, the model {n_layer}")
        if state.type_k != state.type_v:
            raise seqstate.SeqStateError(f"probe: K type {state.type_k} != V type {state.type_v}")
        width = state.k.shape[2]
        if width % n_head_kv or state.v.shape[2] != width:
            raise seqstate.SeqStateError(f"probe: K width {width}, V width {state.v.shape[2]}, {n_head_kv} KV heads")
        self._type_kv = state.type_k
        self._v_trans = state.v_trans
        return Namespace(
            model_fingerprint=file_fingerprint(self.model_path),
            engine=ENGINE,
            engine_version=f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}",
            kv_dtype=seqstate.DTYPE_NAMES[state.type_k],
            flash_attn=self.flash_attn,
            layout=f"{LAYOUT};v_trans={state.v_trans}",
            n_layer=n_layer,
            n_head_kv=n_head_kv,
            head_dim=width // n_head_kv,
        )

    def _get_state(self) -> bytes:
        """The sequence's state, ``llama_state_seq_get_data`` (layout: ``seqstate``)."""
        llama_cpp = self._llama_cpp
        size = llama_cpp.llama_state_seq_get_size(self._ctx, _SEQ)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, _SEQ)
        if written != size:
            raise seqstate.SeqStateError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return bytes(buf)

    # -- tokens and text --------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """Token IDs of ``text``; chat markers such as ``<|im_start|>`` are parsed as special
        tokens; a BOS is added only when the model asks for one (SmolLM2 does not)."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (invalid UTF-8 replaced)."""
        return self.llm.detokenize(list(tokens)).decode("utf-8", "replace")

    def _chat_template(self) -> tuple[str, str, str]:
        """The GGUF's ``tokenizer.chat_template`` with its EOS and BOS texts.

        Raises:
            ValueError: the GGUF has no chat template.
        """
        template = self.llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{self.model_path.name}: the GGUF has no tokenizer.chat_template")
        eos = self.detokenize([self.llm.token_eos()])
        bos = self.detokenize([self.llm.token_bos()]) if self.llm.token_bos() >= 0 else ""
        return template, eos, bos

    # -- the live sequence ------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        """Tokens in the live sequence (``Llama.n_tokens``)."""
        return self.llm.n_tokens

    def _live_tokens(self, end: int) -> np.ndarray:
        return np.asarray(self.llm.input_ids[:end])

    def _truncate(self, n: int) -> None:
        # Llama.eval removes the cells from position n_tokens on before it decodes
        self.llm.n_tokens = n

    def _span_kv(self, spans: Sequence[tuple[int, int]], layers: range, head_start: int,
                 head_end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Rows ``layers`` and the columns of KV heads ``[head_start, head_end)`` of one
        seq-state read (``seqstate.parse``), per span."""
        state = seqstate.parse(self._get_state())
        rows = slice(layers.start, layers.stop, layers.step)
        cols = slice(head_start * self.namespace.head_dim, head_end * self.namespace.head_dim)
        return [
            (np.ascontiguousarray(state.k[rows, start:end, cols]), np.ascontiguousarray(state.v[rows, start:end, cols]))
            for start, end in spans
        ]

    def _load_kv(self, k: np.ndarray, v: np.ndarray, n_tokens: int, tokens: Sequence[int]) -> None:
        """``llama_state_seq_set_data`` of one ``seqstate.serialize`` buffer, then
        ``input_ids[:n]`` and ``n_tokens`` so that the next ``eval`` continues at position n.

        Raises:
            InjectionError: llama.cpp refused the buffer; the sequence has been cleared.
        """
        buf = seqstate.serialize(k, v, self._type_kv, self._type_kv, self._v_trans, _SEQ)
        arr = (ctypes.c_uint8 * len(buf)).from_buffer(buf)
        read = self._llama_cpp.llama_state_seq_set_data(self._ctx, arr, len(buf), _SEQ)
        if read != len(buf):
            self.clear_kv_cache()
            raise InjectionError(f"llama_state_seq_set_data read {read} of {len(buf)} bytes")
        self.llm.input_ids[:n_tokens] = np.asarray(tokens[:n_tokens], dtype=self.llm.input_ids.dtype)
        self.llm.n_tokens = n_tokens

    def usable_prefix(self, available: int, n_prompt: int) -> int:
        """How many of ``available`` stored prompt tokens to inject for a prompt of
        ``n_prompt`` tokens so the result is bit-identical to an uncached run.

        llama.cpp computes a token evaluated alone (a one-token ubatch) through other kernels
        than a token in a batch of two or more: measured on SmolLM2, the logits differ by up
        to 0.55 while batches of any size >= 2 agree to the bit. So every prompt is evaluated
        as batches of >= 2 tokens followed by the last prompt token alone, like a decode step
        (:meth:`prefill_plan`), with or without a cache; the KV of the last prompt token is
        never stored. Injecting ``n_prompt - 2`` tokens would leave a one-token batch, so one
        token fewer is injected then.
        """
        usable = min(available, n_prompt - 1)
        if n_prompt - 1 - usable == 1:
            usable -= 1
        return max(usable, 0)

    def prefill_plan(self, n_past: int, n_prompt: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` evaluation batches for prompt tokens ``n_past..n_prompt-1``:
        batches of 2..n_batch tokens up to the last prompt token, then that token alone
        (see :meth:`usable_prefix`). A one-token batch appears only for a 2-token prompt."""
        plan = []
        end = n_prompt - 1
        pos = n_past
        n_batch = max(int(self.llm.n_batch), 2)
        while pos < end:
            size = min(n_batch, end - pos)
            if end - pos - size == 1:  # never leave a one-token remainder
                size -= 1
            plan.append((pos, pos + size))
            pos += size
        plan.append((end, n_prompt))
        return plan

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, <|im_end|>, ...)."""
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def _eval_batch(self, batch: Sequence[int]) -> None:
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
        """Raw bytes of one token."""
        return self.llm.detokenize([token])

    def perf_counts(self) -> dict:
        """llama.cpp's own counters since the last reset: ``n_p_eval`` (tokens evaluated in
        multi-token batches) and ``n_eval`` (single-token evaluations), as
        ``llama_perf_context`` reports them (it reports 0 as 1: ``std::max(1, n)`` in
        ``src/llama-context.cpp``)."""
        data = self._llama_cpp.llama_perf_context(self._ctx)
        return {"n_p_eval": int(data.n_p_eval), "n_eval": int(data.n_eval)}

    def reset_perf(self) -> None:
        """Zero llama.cpp's perf counters."""
        self._llama_cpp.llama_perf_context_reset(self._ctx)

    def clear_kv_cache(self) -> None:
        """Empty the KV memory (``llama_memory_clear(mem, True)``) and forget the tokens."""
        self._llama_cpp.llama_memory_clear(self._mem, True)
        self.llm.n_tokens = 0

    def close(self) -> None:
        """Free the model and context if this adapter loaded them; a ``Llama`` passed in stays
        open (its owner closes it)."""
        with self.lock:
            llm, self.llm = getattr(self, "llm", None), None
            if llm is not None and self._owns_llm:
                llm.close()
