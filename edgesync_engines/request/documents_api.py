"""The document half of the ``EdgeSync`` facade: add, list, remove and retrieve documents, and
turn a request's ``documents=`` / ``retrieve=`` into a :class:`DocumentPrompt`.

:class:`DocumentsMixin` is mixed into ``router.EdgeSync``; it uses the facade's public
``adapter``, ``store``, ``semantic`` and ``config``.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from edgesync_engines.request.blend import Blended, blend
from edgesync_engines.request.documents import DocumentLibrary, DocumentPrompt, as_inputs, build_prompt
from edgesync_engines.request.plan import hit_tier
from edgesync_store.documents.records import DocumentRecord
from edgesync_store.errors import StoreError

log = logging.getLogger(__name__)


def annotate(result, prompt: DocumentPrompt, scores: list[float] | None, blended: "Blended | None",
             refusal: str | None, computed: int) -> None:
    """Fill a documents request's fields of its ``GenerationResult`` (in place): the document
    IDs and retrieval scores, why a blend was refused, the documents computed, and for a blend
    the approximate flag, the blended and recomputed counts and what they make of
    ``tokens_reused`` (exact head + blended tokens), ``tokens_prefilled`` and the tier."""
    result.documents, result.retrieval_scores = prompt.document_ids, scores
    result.blend_refusal, result.documents_computed = refusal, computed
    if blended is not None:
        result.approximate = True
        result.blended_tokens, result.recomputed_tokens = blended.blended_tokens, blended.recomputed_tokens
        result.tokens_reused = blended.head_reused + blended.blended_tokens
        result.tokens_prefilled = result.prompt_tokens - result.tokens_reused
        result.tier = hit_tier(result.tokens_reused, result.prompt_tokens)


class DocumentsMixin:
    """Documents on the ``EdgeSync`` facade (see :mod:`edgesync_engines.request.documents`)."""

    _library: DocumentLibrary | None = None
    _doc_embedder = None
    _blend_refusal_logged = False

    @property
    def documents(self) -> DocumentLibrary:
        """This engine's documents in the store (a :class:`DocumentLibrary`)."""
        if self._library is None:
            self._library = DocumentLibrary(self.store, self.adapter, self._encode, self.config.chunk_tokens,
                                            self.config.document_header)
        return self._library

    def _encode(self, texts: list[str]) -> np.ndarray:
        """MiniLM embeddings: the semantic lookup's embedder when it runs, else one loaded here."""
        if self.semantic is not None:
            vectors = self.semantic.encode(texts)
            if vectors is not None:
                return vectors
        if self._doc_embedder is None:
            from edgesync_store.semantic.embedders import get_embedder

            self._doc_embedder = get_embedder(self.config.embedding_backend).load()
        return self._doc_embedder.encode(texts)

    def add_documents(self, documents: Iterable["str | Mapping"],
                      progress: Callable[[int], None] | None = None) -> list[DocumentRecord]:
        """Store documents: each one's KV computed once (standalone, only when its chain is not
        stored yet), its record, and its text embedded for retrieval. ``documents`` are strings
        or dicts with ``text`` (or ``context``) and optional ``title``, ``source``;
        ``progress(i)`` is called after each. Returns the records, in order.

        Raises:
            ValueError: a document that is empty, malformed or longer than the context (nothing
                is stored for it or after it), or no store (``store=False``).
            PermissionError: the store is read-only.
            StoreError: the store could not be written.
        """
        if self.store is None or self.adapter.namespace is None:
            raise ValueError("add_documents: needs a store and an engine whose KV can be cached "
                             f"({self.uncached_reason or 'store=False or EDGESYNC_CACHE=0'})")
        inputs = as_inputs(documents)
        out = []
        with self.adapter.lock:
            for i, doc in enumerate(inputs):
                out.append(self.documents.add(self.documents.record_for(doc, i)))
                if progress is not None:
                    progress(i + 1)
        return out

    def list_documents(self) -> list[DocumentRecord]:
        """The stored documents of this engine's namespace."""
        return self.documents.list()

    def remove_documents(self, ids: Iterable["str | DocumentRecord"]) -> int:
        """Remove documents (their IDs, unique ID prefixes of 8+ hex digits, or records) with
        their fragments; the next request with them recomputes them. Returns the documents
        removed.

        Raises:
            KeyError: an ID that names no stored document (or several).
            StoreError: the store could not be written.
        """
        if isinstance(ids, (str, DocumentRecord)):
            ids = [ids]  # one ID, not its characters
        found = []
        for doc_id in ids:
            rec = doc_id if isinstance(doc_id, DocumentRecord) else self.documents.resolve(str(doc_id))
            if rec is None:
                raise KeyError(f"no stored document matches {doc_id!r}: unknown, under 8 hex digits, or a prefix "
                               f"of several (give more digits)")
            found.append(rec)
        for rec in found:
            self.documents.remove(rec)
        self._drop_ram_tier(found)
        return len(found)

    def forget_documents(self, documents: Iterable["str | Mapping"]) -> int:
        """Remove the given documents (as passed to ``generate``) if stored; returns how many."""
        recs = [self.documents.record_for(d, i) for i, d in enumerate(as_inputs(documents))]
        gone = [r for r in recs if self.documents.get(r.key) is not None]
        for rec in gone:
            self.documents.remove(rec)
        self._drop_ram_tier(gone)
        return len(gone)

    def _drop_ram_tier(self, removed: list) -> None:
        """Empty the RAM tier after documents were removed: their decoded KV may sit there
        (it would not be served, the store no longer holding it, but no copy is kept)."""
        if removed and getattr(self, "fragment_cache", None) is not None:
            self.fragment_cache.clear()

    def document_prompt(self, messages: Sequence[Mapping[str, str]], documents=None,
                        retrieve: int | None = None) -> tuple[DocumentPrompt, list[float] | None]:
        """The prompt of ``messages`` with ``documents`` (given) or the ``retrieve`` nearest
        stored ones (:func:`~edgesync_engines.request.documents.build_prompt`), and the
        retrieval scores (None when given).

        Raises:
            ValueError: both or neither given, a bad document, messages not ending with a user
                turn, or ``retrieve`` with no stored documents.
        """
        if (documents is None) == (retrieve is None):
            raise ValueError("documents: pass either documents= or retrieve=, not both")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        scores = None
        if retrieve is not None:
            if not isinstance(retrieve, int) or isinstance(retrieve, bool) or retrieve < 1:
                raise ValueError(f"retrieve: expected an integer >= 1, got {retrieve!r}")
            question = messages[-1].get("content", "") if messages and isinstance(messages[-1], Mapping) else ""
            if not str(question).strip():
                raise ValueError("retrieve: the last message has no text to retrieve by")
            hits = self.documents.retrieve(str(question), retrieve)
            records, scores = [r for r, _ in hits], [round(s, 4) for _, s in hits]
        else:
            if isinstance(documents, (str, Mapping)):
                documents = [documents]
            records = [self.documents.record_for(d, i) for i, d in enumerate(as_inputs(documents))]
        return build_prompt(self.adapter, messages, records), scores

    def store_missing_documents(self, prompt: DocumentPrompt) -> int:
        """Add the prompt's documents whose KV or record the store lacks (their KV computed now:
        the engine's sequence is cleared). Returns how many were added; a store failure is
        logged and the request goes on."""
        if self.store is None or self.store.readonly or self.adapter.namespace is None:
            return 0
        added = 0
        for rec, _ in prompt.pieces:
            try:
                if self.documents.get(rec.key) is None or not self.documents.kv_stored(rec):
                    self.documents.add(rec)
                    added += 1
            except (StoreError, OSError, ValueError, RuntimeError) as exc:
                log.warning("could not store document %s: %s", rec.doc_id[:16], exc)
        return added

    def blend_documents(self, doc_prompt: DocumentPrompt, injector) -> "tuple[Blended | None, str | None, int]":
        """Store the prompt's missing documents and blend it (``request/blend.py``) with
        ``injector`` (None: no store); returns (what the engine holds, None, documents
        computed), or (None, why not, 0) when the engine cannot blend (logged once)."""
        refusal = self.adapter.blend_refusal if injector is not None else "no store"
        if refusal is not None:
            if not self._blend_refusal_logged:
                log.warning("reuse=blend refused, answering exactly: %s", refusal)
                self._blend_refusal_logged = True
            return None, refusal, 0
        computed = self.store_missing_documents(doc_prompt)
        return blend(doc_prompt, injector, self.config), None, computed
