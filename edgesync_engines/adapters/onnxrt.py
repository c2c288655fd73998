"""ONNX Runtime adapter: KV fragments out of and into the ``past_key_values`` of an exported decoder.

The decoder is the export of the same GGUF that llama.cpp runs (``onnx_export``). The live KV
is the ``present.{i}.key`` / ``.value`` arrays, float32 ``[1, n_head_kv, n_tokens, head_dim]``;
fragments hold it unchanged, tokens-major (K in Hugging Face's rotate-half order), so reuse in
this engine is lossless. Prompts are evaluated in batches ending at multiples of ``n_batch``,
then the last token alone, with or without a cache, so an injected prefix on a batch boundary
is followed by the calls of an uncached run and the logits are the same.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from edgesync_engines.adapters.model_files import ModelLoadError, file_fingerprint, model_file
from edgesync_engines.adapters.onnx_export import MODEL_FILE, ExportError, export_dir, is_gguf, open_export, read_meta
from edgesync_engines.adapters.onnx_support import onnx_refusal
from edgesync_engines.adapters.protocol import KERNEL_PROBE_TOKENS, PROBE_TEXT, EngineAdapter, kernel_digest
from edgesync_store.schema import Namespace

log = logging.getLogger(__name__)

ENGINE = "onnxruntime"
LAYOUT = "onnx-hf-rotate-half/tokens-major-v1"
"""Fragment layout: per layer [tokens, heads*head_dim] float32, K in rotate-half order."""
DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 128
_EOG_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "</s>")
"""End-of-generation token texts, besides the export's eos_token_ids (llama.cpp's
``llama_vocab_is_eog`` set for these models)."""
_PROBED_KERNELS: dict[tuple[str, str], str] = {}
""":meth:`OnnxRuntimeAdapter.probe_kernels`' answers in this process, by export directory and format."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: character -> byte (from GPT-2's
    ``encoder.py`` ``bytes_to_unicode``, which the ``tokenizers`` ByteLevel model uses)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class OnnxRuntimeAdapter(EngineAdapter):
    """An ``EngineAdapter`` on an ONNX Runtime session of an exported decoder (batch 1, CPU, float32).

    Args:
        model: the GGUF the export was made from, or None for the configured model.
        export: an export directory to use instead (its ``source_fingerprint`` is the model's).
        n_ctx: context window in tokens.
        n_threads: intra-op threads (default: every usable CPU).
        n_batch: prompt evaluation batch, tokens (batches end at multiples of it; >= 2).
        seed: the sampler's seed when ``generate`` is given none.

    Raises ValueError (``n_batch`` < 2), ModelNotFoundError (no GGUF), ModelLoadError (not a GGUF)
    or ExportError (no export for it, or one of another file).
    """

    def __init__(self, model: "str | os.PathLike | None" = None, export: "str | os.PathLike | None" = None,
                 n_ctx: int = DEFAULT_N_CTX, n_threads: int | None = None, n_batch: int = DEFAULT_N_BATCH,
                 seed: int = 0) -> None:
        self.lock = threading.RLock()
        if n_batch < 2:
            raise ValueError(f"n_batch: must be >= 2, got {n_batch}")
        if export is None:
            path = model_file(model)
            if not is_gguf(path):
                raise ModelLoadError(f"{path}: not a GGUF file (the onnx engine runs the export of a GGUF)")
            refusal = onnx_refusal(path)
            if refusal is not None:  # say why now, rather than ask for an export that would refuse
                raise ExportError(f"the onnx engine cannot serve it: {refusal}")
            directory = export_dir(path)
            meta = read_meta(directory)
            if meta["source_fingerprint"] != file_fingerprint(path):
                raise ExportError(f"{directory}: exported from another file than {path}; "
                                  "export again with `edgesync export-onnx --force`")
            self.model_path = path
        else:
            directory = Path(export)
            self.model_path = Path(model) if model is not None else directory / MODEL_FILE
        meta, self.session, self.tokenizer = open_export(directory, n_threads)
        self.export_dir = directory
        self.meta = meta
        self.n_batch = int(n_batch)
        self.n_ctx = int(n_ctx)
        self.n_layer, self.n_head_kv, self.head_dim = meta["n_layer"], meta["n_head_kv"], meta["head_dim"]
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self._eog = set(int(t) for t in meta["eos_token_ids"]) | {vocab[n] for n in _EOG_NAMES if n in vocab}
        self._special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()} \
            if hasattr(self.tokenizer, "get_added_tokens_decoder") else set()
        self._byte_decoder = _byte_decoder()
        self.seed = seed
        self.tokens_evaluated = 0
        """Tokens run through the decoder since the adapter was made (prompt and decode)."""
        self._closed = False
        self.clear_kv_cache()
        key = (str(directory.resolve()), meta["format"])
        if key not in _PROBED_KERNELS:
            _PROBED_KERNELS[key] = self.probe_kernels()
        self.namespace = Namespace(
            model_fingerprint=meta["source_fingerprint"],
            engine=ENGINE,
            engine_version=f"onnxruntime {importlib.metadata.version('onnxruntime')}; {meta['format']}",
            kv_dtype="f32",
            flash_attn=False,
            layout=LAYOUT,
            n_layer=self.n_layer,
            n_head_kv=self.n_head_kv,
            head_dim=self.head_dim,
            kernels=_PROBED_KERNELS[key],
        )
        log.debug("onnxruntime KV layout: %s", self.namespace)

    def probe_kernels(self) -> str:
        """The kernel digest of this ONNX Runtime build on this machine (``Namespace.kernels``,
        :func:`protocol.kernel_digest`): of the logits for the first
        :data:`protocol.KERNEL_PROBE_TOKENS` tokens of :data:`protocol.PROBE_TEXT` in one call,
        then the next token alone. Clears the KV, before and after; ``tokens_evaluated`` unchanged."""
        tokens = self.tokenize(PROBE_TEXT)[:KERNEL_PROBE_TOKENS + 1]
        counted = self.tokens_evaluated
        self.clear_kv_cache()
        try:
            rows = [self._eval(tokens[:-1])[-1].copy(), self._eval(tokens[-1:])[-1].copy()]
        finally:
            self.clear_kv_cache()
            self.tokens_evaluated = counted
        return kernel_digest(rows)

    # -- state --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    def clear_kv_cache(self) -> None:
        self.kv_epoch += 1
        empty = np.zeros((1, self.n_head_kv, 0, self.head_dim), dtype=np.float32)
        self._past = [empty] * (2 * self.n_layer)
        self._tokens: list[int] = []
        self._logits: np.ndarray | None = None

    def _eval(self, batch: Sequence[int]) -> np.ndarray:
        """Evaluate ``batch`` on top of the live KV; returns logits ``[len(batch), vocab]`` float32."""
        past = self.n_tokens
        n = len(batch)
        feed = {
            "input_ids": np.asarray(batch, dtype=np.int64)[None],
            "attention_mask": np.ones((1, past + n), dtype=np.int64),
            "position_ids": np.arange(past, past + n, dtype=np.int64)[None],
        }
        for i in range(self.n_layer):
            feed[f"past_key_values.{i}.key"] = self._past[2 * i]
            feed[f"past_key_values.{i}.value"] = self._past[2 * i + 1]
        out = self.session.run(None, feed)
        self.tokens_evaluated += n
        self._past = out[1:]
        self._tokens.extend(int(t) for t in batch)
        self._logits = out[0][0, -1]
        return out[0][0]

    # -- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token IDs from the export's tokenizer.json (llama.cpp's IDs); special tokens are
        always parsed and no BOS is added, so ``add_bos`` and ``special`` change nothing."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def token_bytes(self, token: int) -> bytes:
        """Byte-level BPE pieces mapped back to bytes; special tokens as their UTF-8 text."""
        piece = self.tokenizer.id_to_token(int(token))
        if piece is None:
            return b""
        if piece in self._special:
            return piece.encode("utf-8")
        try:
            return bytes(self._byte_decoder[c] for c in piece)
        except KeyError:  # not a byte-level piece
            return self.tokenizer.decode([int(token)], skip_special_tokens=False).encode("utf-8")

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (invalid UTF-8 replaced)."""
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def _chat_template(self) -> tuple[str, str, str]:
        """The GGUF's chat template from the export's metadata (ValueError: none)."""
        if not self.meta.get("chat_template"):
            raise ValueError(f"{self.export_dir}: the export has no chat template")
        eos = self.meta["eos_token_ids"]
        bos = self.meta.get("bos_token_id")
        return (self.meta["chat_template"], self.detokenize(eos[:1]) if eos else "",
                self.detokenize([bos]) if bos is not None else "")

    def is_eog(self, token: int) -> bool:
        """The export's EOS IDs and the chat end markers (:data:`_EOG_NAMES`)."""
        return int(token) in self._eog

    # -- fragments ------------------------------------------------------------------------

    def _live_tokens(self, end: int) -> np.ndarray:
        return np.asarray(self._tokens[:end])

    def _truncate(self, n: int) -> None:
        self._past = [np.ascontiguousarray(p[:, :, :n]) for p in self._past]
        self._tokens = self._tokens[:n]

    def _span_kv(self, spans: Sequence[tuple[int, int]], layers: range, head_start: int,
                 head_end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Float32 ``present.{i}.key/value[0, heads, span, :]`` of the given layers, made
        tokens-major ``[len(layers), span, heads * head_dim]`` (K still in rotate-half order)."""
        width = (head_end - head_start) * self.head_dim

        def rows(offset: int, start: int, end: int) -> np.ndarray:
            # present [1, heads, tokens, head_dim] -> [tokens, heads * head_dim] per layer
            return np.ascontiguousarray(np.stack([
                self._past[2 * layer + offset][0, head_start:head_end, start:end]
                .transpose(1, 0, 2).reshape(end - start, width)
                for layer in layers
            ]))

        return [(rows(0, start, end), rows(1, start, end)) for start, end in spans]

    def _load_kv(self, k: np.ndarray, v: np.ndarray, n_tokens: int, tokens: Sequence[int]) -> None:
        """Make ``past_key_values`` ``[1, n_head_kv, n_tokens, head_dim]`` per layer of K, V."""
        def to_past(x: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(x.reshape(n_tokens, self.n_head_kv, self.head_dim).transpose(1, 0, 2)[None])

        self._past = [to_past(x[layer]) for layer in range(self.n_layer) for x in (k, v)]
        self._tokens = [int(t) for t in tokens[:n_tokens]]
        self._logits = None

    # -- generation -----------------------------------------------------------------------

    def usable_prefix(self, available: int, n_prompt: int) -> int:
        """All but the last prompt token at most (see :meth:`prefill_plan`)."""
        return max(min(available, n_prompt - 1), 0)

    def prefill_plan(self, n_past: int, n_prompt: int) -> list[tuple[int, int]]:
        """Batches ending at multiples of ``n_batch``, then the last prompt token alone."""
        plan, pos, end = [], n_past, n_prompt - 1
        while pos < end:
            stop = min((pos // self.n_batch + 1) * self.n_batch, end)
            plan.append((pos, stop))
            pos = stop
        plan.append((end, n_prompt))
        return plan

    def eval_logits(self, tokens: Sequence[int], n_past: int = 0) -> np.ndarray:
        """Prefill ``tokens[n_past:]`` on the live ``tokens[:n_past]`` in one call: logits
        float32 ``[len(tokens) - n_past, vocab]``, row i predicting the token after position
        n_past + i. ValueError as :meth:`prefill`."""
        self._resume(tokens, n_past)
        return self._eval(tokens[n_past:]).copy()

    def _eval_batch(self, batch: Sequence[int]) -> None:
        self._eval(batch)

    def _sampled_tokens(self, temperature: float, top_p: float, seed: int | None) -> Iterator[int]:
        """The argmax at temperature 0, else top-p over softmax(logits / temperature), numpy's
        PCG64 seeded by ``seed`` (or the adapter's)."""
        rng = np.random.default_rng(self.seed if seed is None else seed)
        while True:
            token = self._sample(self._logits, temperature, top_p, rng)
            yield token
            self._eval([token])

    @staticmethod
    def _sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
        if temperature <= 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
        q = p[keep] / p[keep].sum()
        return int(keep[rng.choice(len(keep), p=q)])

    def close(self) -> None:
        """Drop the session and the KV cache; the adapter is unusable afterwards."""
        with self.lock:
            self._closed = True
            self.session = None
            self._past = []
            self._tokens = []
