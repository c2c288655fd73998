"""The router's semantic lookup: nominate donor prompts by meaning, and remember new ones.

A request whose prefix walk leaves at least ``semantic_min_uncovered`` prompt tokens uncovered
embeds what tells it apart (``prompt_text.embed_text_for``: the last user turn, or the tail of a
raw prompt) with MiniLM-L6-v2 and asks the HNSW index for the nearest stored prompts. Each
indexed prompt ("donor") is keyed by the last fragment of its chain; its token IDs from position
0 are in the store's ``donors`` database (``edgesync_store.semantic.donors``). The reuse plan then checks a
donor token by token (default mode) or, in the opt-in approximate mode, serves it whole.

Everything here degrades instead of failing a request: a missing package, an index of another
embedding backend or an unreadable store turn the lookup off with one warning; the request then
runs on the exact prefix walk alone.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgesync_engines.config import EdgeSyncConfig
from edgesync_store.errors import StoreError
from edgesync_store.schema import Namespace
from edgesync_store.semantic.donors import delete_donor, get_donor, put_donor

log = logging.getLogger(__name__)

QUERY_K = 8
"""Nearest neighbours asked of the index per lookup (candidates of other namespaces and below
``similarity_partial`` are dropped afterwards)."""


@dataclass
class Donor:
    """A nominated stored prompt.

    Attributes:
        key: store key of the last fragment of the donor's chain (the index's key).
        similarity: cosine between the request's and the donor's embeddings, in [-1, 1].
        tokens: the donor prompt's token IDs from position 0 (int32 ``[n]``).
    """

    key: bytes
    similarity: float
    tokens: np.ndarray


@dataclass
class Lookup:
    """What one semantic lookup found: ``similarity`` of the best candidate of this namespace
    (None when there was none), the candidates at or above ``similarity_partial`` (most similar
    first), and the request's (text, embedding float32 ``[384]``), reused when it is indexed."""

    similarity: float | None
    donors: list[Donor]
    embedded: tuple[str, np.ndarray]


class SemanticLookup:
    """The embedder and the HNSW index of one store, opened on first use.

    Args:
        store: the router's open ``FragmentStore``.
        config: supplies ``embedding_backend``, ``ef_search`` and ``similarity_partial``.

    Thread-safe (the index has its own lock; loading is guarded here).
    """

    def __init__(self, store, config: EdgeSyncConfig) -> None:
        self.store = store
        self.config = config
        self._lock = threading.Lock()
        self._embedder = None
        self._index = None
        self.disabled_reason: str | None = None

    def _ready(self) -> bool:
        """Load the embedder and open the index once; False (and a warning) when impossible."""
        if self.disabled_reason is not None:
            return False
        if self._index is not None:
            return True
        with self._lock:
            if self._index is not None or self.disabled_reason is not None:
                return self._index is not None
            try:
                from edgesync_store.semantic.embedders import EmbeddingUnavailableError, get_embedder
                from edgesync_store.semantic.index import BackendMismatchError, IndexUnavailableError, SemanticIndex
            except ImportError as exc:  # pragma: no cover - numpy-level breakage
                return self._disable(f"cannot import the semantic modules: {exc}")
            try:
                embedder = get_embedder(self.config.embedding_backend)
                embedder.load()
                self._index = SemanticIndex(self.store, embedder.backend_id, ef_search=self.config.ef_search)
                self._embedder = embedder
            except (EmbeddingUnavailableError, IndexUnavailableError) as exc:
                return self._disable(str(exc))
            except BackendMismatchError as exc:
                return self._disable(_mismatch_text(exc, self.store.path))
            except (StoreError, OSError, RuntimeError) as exc:
                return self._disable(f"cannot open the semantic index: {exc}")
            return True

    def wait_ready(self) -> bool:
        """Block until the embedder is loaded and the index open (what :meth:`warm_up` does in
        the background); True when the lookup can run, False when it is disabled."""
        return self._ready()

    def warm_up(self) -> None:
        """Load the embedder and open the index in a daemon thread, so that the first lookup
        does not pay for it (about 0.5 s); a lookup meanwhile waits for it."""
        threading.Thread(target=self._ready, name="edgesync-semantic-warm-up", daemon=True).start()

    def _disable(self, reason: str) -> bool:
        self.disabled_reason = reason
        log.warning("semantic lookup off: %s", reason)
        return False

    def embed(self, prompt: "str | Sequence[dict]") -> tuple[str, np.ndarray] | None:
        """The text that represents the request and its embedding (float32 ``[384]``, unit
        length), or None when the lookup is off or the text is blank."""
        if not self._ready():
            return None
        from edgesync_engines.request.prompt_text import embed_text_for

        text = embed_text_for(prompt)
        if not text.strip():
            return None
        return text, self._embedder.encode([text])[0]

    def encode(self, texts: Sequence[str]) -> np.ndarray | None:
        """Embeddings of ``texts`` (float32 ``[n, 384]``, unit rows) with the lookup's embedder,
        or None when the lookup is off."""
        if not self._ready():
            return None
        return self._embedder.encode(list(texts))

    def nominate(self, prompt: "str | Sequence[dict]", namespace: Namespace) -> Lookup | None:
        """Embed the request and return the stored donors of ``namespace`` nearest to it.

        Returns None when the lookup is off (see :attr:`disabled_reason`) or failed (logged).
        """
        embedded = self.embed(prompt)
        if embedded is None:
            return None
        digest = namespace.digest()
        from edgesync_store.semantic.index import BackendMismatchError

        try:
            hits = self._index.query(embedded[1], k=QUERY_K)
            best, donors = None, []
            for key, sim in hits:
                record = get_donor(self.store, key)
                if record is None or record.namespace_digest != digest:
                    continue
                best = sim if best is None else max(best, sim)
                if sim >= self.config.similarity_partial:
                    donors.append(Donor(key, sim, record.tokens))
        except BackendMismatchError as exc:  # another process re-embedded the store meanwhile
            self._disable(_mismatch_text(exc, self.store.path))
            return None
        except (StoreError, OSError, RuntimeError, AttributeError) as exc:
            log.warning("semantic lookup failed, using the prefix walk alone: %s", exc)
            return None
        return Lookup(best, donors, embedded)

    def contains(self, key: bytes) -> bool:
        """True when ``key`` is indexed (False when the lookup is off)."""
        return self._ready() and key in self._index

    def index_if_ready(self):
        """The open ``SemanticIndex`` once loaded, else None (never waits; for the store jobs,
        which share it, and its lock, with the request path)."""
        return self._index if self.ready_now() else None

    def ready_now(self) -> bool:
        """True when the embedder and index are loaded (never waits for them)."""
        return self._index is not None and self.disabled_reason is None

    def remember(self, key: bytes, namespace: Namespace, tokens: Sequence[int], prompt, embedded=None) -> bool:
        """Index a stored prompt: its embedding under ``key`` (the last fragment of its
        chain, which must be stored) and its token IDs and text in the donors database.
        ``embedded`` is the request's (text, vector) when the lookup already computed it.
        Returns False when the lookup is off or the write failed (logged)."""
        if embedded is None:
            embedded = self.embed(prompt)
        if embedded is None:
            return False
        text, vector = embedded
        try:
            put_donor(self.store, key, namespace.digest(), tokens, text)
            self._index.add(key, vector)
        except (StoreError, OSError, KeyError, ValueError, RuntimeError, AttributeError) as exc:
            log.warning("could not index the prompt: %s", exc)
            return False
        return True

    def forget(self, key: bytes) -> None:
        """Drop a donor whose chain is gone (vector and token record)."""
        try:
            if self._index is not None:
                self._index.remove(key)
            delete_donor(self.store, key)
        except (StoreError, OSError, ValueError, RuntimeError) as exc:
            log.warning("could not drop donor %s: %s", key.hex()[:16], exc)

    @property
    def backend_id(self) -> str | None:
        """The loaded embedder's id, or None before first use."""
        return None if self._embedder is None else self._embedder.backend_id

    def close(self) -> None:
        """Save the sidecar (when it changed) and close the index (idempotent)."""
        with self._lock:
            if self._index is not None:
                try:
                    self._index.close()
                except (OSError, RuntimeError, StoreError) as exc:
                    log.warning("could not save the semantic index: %s", exc)
                self._index = None
            self.disabled_reason = self.disabled_reason or "closed"


def _mismatch_text(exc, path) -> str:
    """The warning for a store whose vectors another embedding backend wrote."""
    return (f"the store {path} holds vectors of embedding backend {exc.recorded!r}, not {exc.requested!r}; "
            f"set EDGESYNC_EMBEDDING_BACKEND to match, or re-embed with `edgesync reindex {path} --backend NAME`")
