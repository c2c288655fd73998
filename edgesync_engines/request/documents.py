"""Documents on the request path: adding them (KV computed once), listing, removing, retrieving
them by meaning, and the one prompt template that puts them before a question.

The template (:func:`build_prompt`), for chat messages whose last turn is the user's question::

    [chat template up to the last user turn's content]  (the "head": system part and earlier turns)
    [document 1's own tokens] SEP [document 2's own tokens] SEP ... [document k's] SEP
    [the question + the chat template's closing of the turn and assistant prompt]

SEP is ``"\\n\\n"`` tokenized alone (:data:`SEPARATOR`). Each document is tokenized on its own
(no BOS, special tokens not parsed: a document's text cannot open a chat turn), so its token
IDs, hence its stored KV, are the same wherever it appears. The uncached reference of a
documents request is this same token sequence prefilled in full
(``EdgeSync(store=False).generate(messages, documents=...)``).

A document's KV is computed once, after a fixed header (``document_header``: by default the
chat template's rendering up to an empty user turn, i.e. the model's default system part; or
none), and stored as the chain ``header + document tokens`` from position 0
(``schema.chunk_spans`` of its length, the last chunk absorbing a remainder under 64 tokens) in
the document lifetime; a blend places only the document's own cells (the header gives
them the context a full prefill would). A document under 64 tokens (``MIN_SPAN``) has no
fragment: a blend recomputes it whole. Its text is embedded for retrieval in windows of
:data:`WINDOW_WORDS` words (MiniLM-L6-v2 reads 256 word pieces), overlapping by
:data:`WINDOW_OVERLAP`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from edgesync_store.documents import records
from edgesync_store.documents.records import DocumentRecord
from edgesync_store.documents.retrieval import DocumentIndex, keep_as_document
from edgesync_store.errors import MissingExtraError, StoreError
from edgesync_store.schema import chunk_spans, prefix_hash

log = logging.getLogger(__name__)

SEPARATOR = "\n\n"
"""Text between documents, and between the last document and the question."""
WINDOW_WORDS = 150
"""Words per embedded window (about 200 MiniLM word pieces: under its 256)."""
WINDOW_OVERLAP = 30
_QUESTION_MARK = "EdgeSyncQuestion7f3a9c"
"""Stands for the question while the chat template renders, to split head from tail (plain
letters: llama.cpp's built-in templates take C strings, and Jinja templates may trim)."""


@dataclass(frozen=True)
class DocumentInput:
    """A document as given: ``text`` and optional ``title`` and ``source``."""

    text: str
    title: str = ""
    source: str = ""


def as_inputs(documents: "Iterable[str | Mapping] | str | Mapping") -> list[DocumentInput]:
    """Documents given as strings or as dicts with ``text`` (or ``context``) and optional
    ``title``, ``source`` (or ``doc_id``/``id``); a single string or dict is one document.

    Raises:
        ValueError: ``documents`` not iterable, or a document that is not a string or such a
            dict, whose text is blank, or whose text, title or source holds a lone surrogate
            (not valid Unicode text), naming its index.
    """
    if isinstance(documents, (str, Mapping)):
        documents = [documents]  # one document, not its characters or keys
    if not isinstance(documents, Iterable):
        raise ValueError(f"documents: expected a list of strings or dicts, got {type(documents).__name__}")
    out = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            text, title, source = doc, "", ""
        elif isinstance(doc, Mapping):
            text = doc.get("text", doc.get("context"))
            title = doc.get("title") or ""
            source = doc.get("source") or doc.get("doc_id") or doc.get("id") or ""
            if not isinstance(text, str):
                raise ValueError(f"documents[{i}]: a dict needs a string 'text' (or 'context')")
        else:
            raise ValueError(f"documents[{i}]: expected a string or a dict with 'text', got {type(doc).__name__}")
        if not text.strip():
            raise ValueError(f"documents[{i}]: the text is empty")
        for name, value in (("text", text), ("title", str(title)), ("source", str(source))):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, which no tokenizer can encode
                raise ValueError(f"documents[{i}]: the {name} must be valid Unicode text, got a lone "
                                 f"surrogate {value[e.start]!r} at character {e.start}") from None
        out.append(DocumentInput(text, str(title), str(source)))
    return out


def text_windows(text: str, words: int = WINDOW_WORDS, overlap: int = WINDOW_OVERLAP) -> list[str]:
    """``text`` cut into windows of ``words`` words overlapping by ``overlap`` (one window for a
    short text)."""
    parts = text.split()
    if len(parts) <= words:
        return [" ".join(parts)]
    step = max(1, words - overlap)
    return [" ".join(parts[i:i + words]) for i in range(0, len(parts) - overlap, step)]


@dataclass(frozen=True)
class DocumentPrompt:
    """A prompt built by :func:`build_prompt`.

    Attributes:
        tokens: the whole prompt's token IDs.
        head_len: tokens before the first document (exact prefix reuse covers them).
        pieces: ``(record, offset)`` per document, in prompt order: its tokens are
            ``tokens[offset:offset + len(record.tokens)]``.
        question_start: the position of the separator after the last document.
    """

    tokens: tuple[int, ...]
    head_len: int
    pieces: tuple[tuple[DocumentRecord, int], ...]
    question_start: int

    @property
    def document_ids(self) -> list[str]:
        """The documents' IDs (64 hex digits), in prompt order."""
        return [rec.doc_id for rec, _ in self.pieces]


def build_prompt(adapter, messages: Sequence[Mapping[str, str]], docs: Sequence[DocumentRecord]) -> DocumentPrompt:
    """The prompt of the module docstring for chat ``messages`` (the last one the user's
    question) and ``docs`` in that order.

    Raises:
        ValueError: messages that do not end with a user turn, or a chat template that drops
            the question's text.
    """
    if isinstance(messages, str) or not messages or not isinstance(messages[-1], Mapping) \
            or messages[-1].get("role") != "user":
        raise ValueError("documents: the prompt must be chat messages ending with the user's question")
    marked = [*messages[:-1], {**messages[-1], "content": _QUESTION_MARK}]
    rendered = adapter.apply_chat_template(marked)
    if rendered.count(_QUESTION_MARK) != 1:
        raise ValueError("documents: the chat template does not render the question once; cannot place documents")
    head_text, tail_text = rendered.split(_QUESTION_MARK)
    tokens = list(adapter.tokenize(head_text))
    head_len = len(tokens)
    sep = adapter.tokenize(SEPARATOR, add_bos=False, special=False)
    pieces = []
    for rec in docs:
        if pieces:
            tokens += sep
        pieces.append((rec, len(tokens)))
        tokens += [int(t) for t in rec.tokens]
    question_start = len(tokens)
    if docs:
        tokens += sep
    tokens += adapter.tokenize(messages[-1]["content"] + tail_text, add_bos=False)
    return DocumentPrompt(tuple(tokens), head_len, tuple(pieces), question_start)


class DocumentLibrary:
    """The documents of one engine's namespace in one store.

    Args:
        store: the open store (None: documents are tokenized and placed in prompts, but
            nothing is stored or retrieved).
        adapter: the engine (its namespace keys the records; the caller holds its lock while
            KV is computed).
        encode: texts -> float32 ``[n, 384]`` unit embeddings (None: documents are not embedded,
            and :meth:`retrieve` is refused).
        chunk_tokens: fragment span of the documents' chains.
    """

    def __init__(self, store, adapter, encode: Callable[[list[str]], np.ndarray] | None,
                 chunk_tokens: int = 128, header: str = "none") -> None:
        self.store = store
        self.adapter = adapter
        self.encode = encode
        self.chunk_tokens = chunk_tokens
        self.header = header
        self._index = None
        self._header_tokens: list[int] | None = None
        self._warned_unembedded = False
        self._checked_generation = -1

    def header_tokens(self) -> list[int]:
        """The tokens a new document's KV is computed after (``header``: ``"none"`` or
        ``"chat"``, module docstring)."""
        if self._header_tokens is None:
            self._header_tokens = []
            if self.header == "chat":
                rendered = self.adapter.apply_chat_template([{"role": "user", "content": _QUESTION_MARK}])
                self._header_tokens = list(self.adapter.tokenize(rendered.split(_QUESTION_MARK)[0]))
        return self._header_tokens

    @property
    def namespace(self):
        """The engine's namespace."""
        return self.adapter.namespace

    def record_for(self, doc: DocumentInput, index: int = 0) -> DocumentRecord:
        """The record of ``doc`` (the stored one when there is one; else built, not stored).

        Raises:
            ValueError: it tokenizes to nothing, or does not fit the context alone.
        """
        tokens = self.adapter.tokenize(doc.text, add_bos=False, special=False)
        if not tokens:
            raise ValueError(f"documents[{index}]: tokenizes to nothing")
        if len(tokens) >= self.adapter.n_ctx:
            raise ValueError(f"documents[{index}]: {len(tokens)} tokens do not fit the context of "
                             f"{self.adapter.n_ctx} tokens; split the document or raise n_ctx (EDGESYNC_N_CTX)")
        digest = self.namespace.digest() if self.namespace is not None else b"\0" * 32
        key = records.document_key(digest, tokens)
        stored = self.get(key)
        if stored is not None:
            return stored
        return DocumentRecord(digest, np.asarray(tokens, np.int32), np.asarray(self.header_tokens(), np.int32),
                              doc.title, doc.source, doc.text, time.time())

    def get(self, key: bytes) -> DocumentRecord | None:
        """The stored record under ``key`` (None: none, no store, or unreadable: logged)."""
        if self.store is None:
            return None
        try:
            return records.get_document(self.store, key)
        except StoreError as exc:
            log.warning("document records unreadable: %s", exc)
            return None

    def kv_stored(self, rec: DocumentRecord) -> bool:
        """True when the prefix walk of the document's chain reaches its end, whatever fragments
        do it (compaction may have replaced its own chunks by a longer prompt's)."""
        chain = rec.chain
        if not chunk_spans(len(chain), self.chunk_tokens):
            return False
        return self.store.prefix_walk(self.namespace, chain).matched_tokens >= len(chain)

    def add(self, rec: DocumentRecord) -> DocumentRecord:
        """Store ``rec``: its KV (computed standalone when its chain is not all stored: the
        engine's sequence is cleared), its record and its embeddings. Returns the record
        stored (with its vectors).

        Raises:
            StoreError: the store could not be written.
            PermissionError: the store is read-only.
        """
        if self.store is None or self.namespace is None:
            return rec
        chain = rec.chain
        spans = chunk_spans(len(chain), self.chunk_tokens)
        if spans and not self.kv_stored(rec):
            self.adapter.prefill(chain)
            missing = [(s, e) for s, e in spans
                       if not self.store.covers_span(self.namespace, prefix_hash(chain[:s]), chain[s:e], s)]
            self.store.put_many(self.adapter.extract_fragments(chain, missing, now=self.store.clock()))
            self.adapter.clear_kv_cache()
        if spans:
            keep_as_document(self.store, self.store.keys_along(self.namespace, chain))
        if not len(rec.vectors):
            rec = self._with_vectors(rec)
        records.put_document(self.store, rec)
        return rec

    def _with_vectors(self, rec: DocumentRecord) -> DocumentRecord:
        """``rec`` with its text windows embedded; unchanged when there is no embedder or its
        extra is missing (exact reuse needs no embedding: :meth:`retrieve` embeds such records
        once the extra is there)."""
        if self.encode is None:
            return rec
        try:
            vectors = np.asarray(self.encode(text_windows(rec.text)), np.float32)
        except MissingExtraError as exc:
            if not self._warned_unembedded:
                self._warned_unembedded = True
                log.warning("documents stored for exact reuse, not embedded for retrieve=: %s", exc)
            return rec
        return DocumentRecord(rec.namespace_digest, rec.tokens, rec.header, rec.title, rec.source, rec.text,
                              rec.added_at, vectors)

    def _embed_unembedded(self) -> None:
        """Embed the stored records that were added without their vectors (the semantic extra
        was missing then), once per change of the documents database."""
        generation = records.documents_generation(self.store)
        if generation == self._checked_generation:
            return
        for rec in self.list():
            if not len(rec.vectors) and rec.text and len((embedded := self._with_vectors(rec)).vectors):
                records.put_document(self.store, embedded)
        self._checked_generation = records.documents_generation(self.store)

    def list(self) -> list[DocumentRecord]:
        """This namespace's stored documents, in key order."""
        if self.store is None or self.namespace is None:
            return []
        return list(records.iterate_documents(self.store, self.namespace.digest()))

    def resolve(self, doc_id: str) -> DocumentRecord | None:
        """The stored document whose ID is ``doc_id`` or starts with it (at least 8 hex
        digits; None when none or several match)."""
        doc_id = doc_id.strip().lower()
        if len(doc_id) < 8:
            return None
        found = [r for r in self.list() if r.doc_id.startswith(doc_id)]
        return found[0] if len(found) == 1 else None

    def remove(self, rec: DocumentRecord) -> int:
        """Delete ``rec``'s record and every fragment along its chain; returns the fragments
        removed (the next request with it recomputes it).

        Raises:
            StoreError: the store could not be written.
        """
        removed = self.store.forget_tokens(self.namespace, rec.chain) if len(rec.chain) else 0
        records.delete_document(self.store, rec.key)
        return removed

    def retrieve(self, query: str, k: int) -> list[tuple[DocumentRecord, float]]:
        """The ``k`` stored documents nearest to ``query`` by meaning, best first, with their
        cosine similarity.

        Raises:
            ValueError: ``k`` < 1, no embedder, or no stored documents for this model.
            MissingExtraError: the embedding model cannot load (the ``semantic`` extra).
        """
        if k < 1:
            raise ValueError(f"retrieve: k must be >= 1, got {k}")
        if self.store is None or self.encode is None:
            raise ValueError("retrieve: needs a store and the semantic embedder (EDGESYNC_SEMANTIC=1)")
        self._embed_unembedded()
        if self._index is None:
            self._index = DocumentIndex(self.store, self.namespace.digest())
        hits = self._index.search(self.encode([query])[0], k)
        if not hits:
            raise ValueError("retrieve: the store holds no documents for this model; add them with "
                             "EdgeSync.add_documents or `edgesync docs add`")
        out = []
        for key, score in hits:
            rec = self.get(key)
            if rec is not None:
                out.append((rec, score))
        return out
