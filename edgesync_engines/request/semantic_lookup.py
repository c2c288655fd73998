"""The router's semantic lookup: nominate donor prompts by meaning (MiniLM-L6-v2 embeddings,
HNSW index; donors keyed by the last fragment of their chain), and index stored ones.

Loads nothing until first used. Everything degrades instead of failing a request: a missing
package, an index of another backend or an unreadable store turn the lookup off with one warning.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from edgesync_engines.config import EdgeSyncConfig
from edgesync_store.errors import StoreError
from edgesync_store.schema import Namespace
from edgesync_store.semantic.donors import delete_donor, embed_unindexed, get_donor, pending_generation, put_donor

if TYPE_CHECKING:
    from edgesync_store.core.backend import MaintenanceBackend

log = logging.getLogger(__name__)

WARM_UP_THREAD = "edgesync-semantic-warm-up"
"""Name of the thread :meth:`SemanticLookup.warm_up` loads the embedder and index in."""

QUERY_K = 8
"""Nearest neighbours asked of the index per lookup (candidates of other namespaces and below
``similarity_partial`` are dropped afterwards)."""
CATCH_UP_BATCH = 16
"""Donor texts embedded per batch by the catch-up (it checks for :meth:`SemanticLookup.close`
between batches)."""


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

    ``config`` supplies ``embedding_backend``, ``ef_search`` and ``similarity_partial``.
    Creating one loads nothing. Thread-safe (the index has its own lock; loading and the catch-up
    are guarded here).
    """

    def __init__(self, store: "MaintenanceBackend", config: EdgeSyncConfig) -> None:
        self.store = store
        self.config = config
        self._lock = threading.Lock()
        self._embedder = None
        self._index = None
        self.disabled_reason: str | None = None
        self._closing = threading.Event()
        self._catch_lock = threading.Lock()  # one catch-up at a time
        self._catch_state = threading.Lock()  # guards the two flags below
        self._catching = self._catch_again = False
        self._idle = threading.Event()
        self._idle.set()
        self._pending_seen: int | None = None  # the pending counter the last catch-up started from

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
                index = SemanticIndex(self.store, embedder.backend_id, ef_search=self.config.ef_search)
                self._embedder = embedder  # before the index: other threads test the index alone
                self._index = index
            except (EmbeddingUnavailableError, IndexUnavailableError) as exc:
                return self._disable(str(exc))
            except BackendMismatchError as exc:
                return self._disable(_mismatch_text(exc, self.store.path))
            except (StoreError, OSError, RuntimeError) as exc:
                return self._disable(f"cannot open the semantic index: {exc}")
            log.debug("semantic lookup of %s loaded (%s)", self.store.path, embedder.backend_id)
            if not self.store.readonly:
                self._schedule_catch_up()
            return True

    def wait_ready(self) -> bool:
        """Block until the embedder is loaded and the index open (what :meth:`warm_up` does in
        the background); True when the lookup can run, False when it is disabled."""
        return self._ready()

    def warm_up(self) -> None:
        """Load the embedder and open the index in a daemon thread, so that the first lookup
        does not pay for it; a lookup meanwhile waits for it."""
        threading.Thread(target=self._ready, name=WARM_UP_THREAD, daemon=True).start()

    # -- the catch-up: embedding donor records stored without a vector ---------------------

    def catch_up(self) -> int:
        """Embed the stored donor records that have no vector, in batches of
        :data:`CATCH_UP_BATCH`, and index them; returns how many were added (0 when the lookup
        is off, the store read-only, or on a failure, logged). One runs at a time."""
        if self.store.readonly or not self._ready():
            return 0
        from edgesync_store.semantic.index import BackendMismatchError

        with self._catch_lock:
            try:
                # read first: a record written during the run moves the counter past it
                self._pending_seen = pending_generation(self.store)
                added = embed_unindexed(self.store, self._index, self._embedder.encode, CATCH_UP_BATCH,
                                        stop=self._closing)
            except BackendMismatchError as exc:  # another process re-embedded the store meanwhile
                self._disable(_mismatch_text(exc, self.store.path))
                return 0
            except (StoreError, OSError, RuntimeError, ValueError) as exc:
                log.warning("could not embed the stored prompts that lack a vector: %s", exc)
                return 0
            return added

    def wait_caught_up(self, timeout: float | None = None) -> bool:
        """Block until no background catch-up runs (``timeout`` seconds at most); True when none runs."""
        return self._idle.wait(timeout)

    def _schedule_catch_up(self) -> None:
        """Run :meth:`catch_up` in a daemon thread, or once more after the running one."""
        with self._catch_state:
            if self._closing.is_set():
                return
            if self._catching:
                self._catch_again = True
                return
            self._catching, self._catch_again = True, False
            self._idle.clear()
        threading.Thread(target=self._catch_up_loop, name="edgesync-semantic-catch-up", daemon=True).start()

    def _catch_up_loop(self) -> None:
        again = True
        while again:
            try:
                self.catch_up()
            except Exception:  # noqa: BLE001 - a background thread logs; it never prints or dies loudly
                log.exception("semantic catch-up failed on %s", self.store.path)
            with self._catch_state:
                again = self._catch_again and not self._closing.is_set()
                self._catch_again = False
                if not again:
                    self._catching = False
                    self._idle.set()

    def _check_pending(self) -> None:
        """Schedule a catch-up when donor records without a vector were written since the last
        one started (one read of the store's pending counter)."""
        if self.store.readonly:
            return
        try:
            if pending_generation(self.store) != self._pending_seen:
                self._schedule_catch_up()
        except StoreError as exc:
            log.debug("pending donor counter unreadable: %s", exc)

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
        """Embed the request and return the stored donors of ``namespace`` nearest to it; None
        when the lookup is off (:attr:`disabled_reason`) or failed (logged)."""
        embedded = self.embed(prompt)
        if embedded is None:
            return None
        self._check_pending()
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
    def embedder(self):
        """The loaded ``Embedder``, or None: nothing semantic was needed yet (or it failed)."""
        return self._embedder

    def close(self) -> None:
        """Stop the catch-up (between batches) and wait for it, save the sidecar (when it
        changed) and close the index (idempotent)."""
        self._closing.set()
        self._idle.wait()
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
