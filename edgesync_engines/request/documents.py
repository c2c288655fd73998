"""Documents on the request path (:class:`DocumentLibrary`: adding them, their KV computed once,
listing, removing, retrieving by meaning; :class:`DocumentRequest`: a request with documents),
and the one prompt template that puts them before a question (:func:`build_prompt`)::

    [chat template up to the last user turn's content]  (the "head")
    [document 1's tokens] SEP [document 2's tokens] SEP ... [document k's] SEP
    [the question + the chat template's closing of the turn and assistant prompt]

SEP is :data:`SEPARATOR` tokenized alone. Each document is tokenized alone (no BOS, special
tokens not parsed), so its token IDs and stored KV are the same wherever it appears. Its KV is
computed once after a fixed header (``document_header``) and stored as the chain
``header + document`` from position 0 in the document lifetime (under ``MIN_SPAN`` tokens: none).

"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import numpy as np

from edgesync_engines.request.checks import check_messages_text, check_text
from edgesync_engines.request.execute import Injection
from edgesync_engines.request.plan import ReuseMode, ReusePlan, hit_kind
from edgesync_store.documents import records
from edgesync_store.documents.records import DocumentRecord
from edgesync_store.documents.retrieval import DocumentIndex, keep_as_document
from edgesync_store.errors import MissingExtraError, StoreError
from edgesync_store.schema import chunk_spans, prefix_hash

if TYPE_CHECKING:
    from edgesync_engines.request.blend import Blended
    from edgesync_engines.request.fragment_cache import FragmentCache
    from edgesync_engines.request.result import GenerationResult
    from edgesync_engines.request.reuse import ExactReuse, SemanticReuse

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
    """Documents given as strings or dicts with ``text`` (or ``context``) and optional ``title``,
    ``source`` (or ``doc_id``/``id``); a single string or dict is one document.

    Raises ValueError (naming the index) for a non-iterable, a bad item, a blank text or a lone surrogate.
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
    """``text`` cut into windows of ``words`` words overlapping by ``overlap``."""
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

    Raises ValueError when messages do not end with a user turn or the template drops the question.
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
        header: ``"none"`` or ``"chat"`` (``document_header``).
        ram: the engine's RAM tier, emptied when documents are removed (it may hold their KV).
    """

    def __init__(self, store, adapter, encode: Callable[[list[str]], np.ndarray] | None,
                 chunk_tokens: int = 128, header: str = "none", ram: "FragmentCache | None" = None) -> None:
        self.store = store
        self.ram = ram
        self.blend_refusal_logged = False
        self.adapter = adapter
        self.encode = encode
        self.chunk_tokens = chunk_tokens
        self.header = header
        self._index = None
        self._header_tokens: list[int] | None = None
        self._warned_unembedded = False
        self._checked_generation = -1

    def header_tokens(self) -> list[int]:
        """The tokens a new document's KV is computed after."""
        if self._header_tokens is None:
            self._header_tokens = []
            if self.header == "chat":
                rendered = self.adapter.apply_chat_template([{"role": "user", "content": _QUESTION_MARK}])
                self._header_tokens = list(self.adapter.tokenize(rendered.split(_QUESTION_MARK)[0]))
        return self._header_tokens

    @property
    def namespace(self):
        return self.adapter.namespace

    def record_for(self, doc: DocumentInput, index: int = 0) -> DocumentRecord:
        """The record of ``doc`` (the stored one, else built, not stored).

        Raises ValueError when it tokenizes to nothing or does not fit the context alone."""
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
        """The prefix walk of the document's chain reaches its end (through any fragments)."""
        chain = rec.chain
        if not chunk_spans(len(chain), self.chunk_tokens):
            return False
        return self.store.prefix_walk(self.namespace, chain).matched_tokens >= len(chain)

    def add(self, rec: DocumentRecord) -> DocumentRecord:
        """Store ``rec``'s KV (computed when its chain is not all stored: the engine's sequence is
        cleared), its record and its embeddings; returns the record stored (with its vectors).

        Raises StoreError when the store could not be written, PermissionError when read-only."""
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
        """``rec`` with its text windows embedded; unchanged without an embedder or its extra."""
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
        """Embed the stored records added without vectors, once per change of the documents."""
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
        """Delete ``rec``'s record and every fragment along its chain; returns the fragments removed.

        Raises StoreError when the store could not be written."""
        removed = self.store.forget_tokens(self.namespace, rec.chain) if len(rec.chain) else 0
        records.delete_document(self.store, rec.key)
        return removed

    def retrieve(self, query: str, k: int) -> list[tuple[DocumentRecord, float]]:
        """The ``k`` stored documents nearest to ``query`` by meaning, best first, with their cosine similarity.

        Raises ValueError (``k`` < 1, no embedder, no stored documents), MissingExtraError (no ``semantic`` extra).
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

    def add_all(self, documents: "Iterable[str | Mapping]", progress: Callable[[int], None] | None = None
                ) -> list[DocumentRecord]:
        """:meth:`add` each of ``documents`` (as :func:`as_inputs` takes them), calling
        ``progress(i)`` after the i-th; returns the records, in order (the caller holds the
        engine's lock).

        Raises ValueError for a bad document (nothing stored for it or after it); else as :meth:`add`.
        """
        out = []
        for i, doc in enumerate(as_inputs(documents)):
            out.append(self.add(self.record_for(doc, i)))
            if progress is not None:
                progress(i + 1)
        return out

    def remove_ids(self, ids: "Iterable[str | DocumentRecord]") -> int:
        """Remove documents (IDs, unique ID prefixes of 8+ hex digits, or records) with their
        fragments; returns how many.

        Raises KeyError for an ID naming no stored document (or several), StoreError on a write failure.
        """
        if isinstance(ids, (str, DocumentRecord)):
            ids = [ids]  # one ID, not its characters
        found = []
        for doc_id in ids:
            rec = doc_id if isinstance(doc_id, DocumentRecord) else self.resolve(str(doc_id))
            if rec is None:
                raise KeyError(f"no stored document matches {doc_id!r}: unknown, under 8 hex digits, or a prefix "
                               f"of several (give more digits)")
            found.append(rec)
        return self.remove_records(found)

    def forget(self, documents: "Iterable[str | Mapping]") -> int:
        """Remove the given documents (as ``generate`` takes them) if stored; returns how many."""
        recs = [self.record_for(d, i) for i, d in enumerate(as_inputs(documents))]
        return self.remove_records([r for r in recs if self.get(r.key) is not None])

    def remove_records(self, recs: list[DocumentRecord]) -> int:
        """Remove stored documents and empty the RAM tier (a copy of their KV is never served
        once the store lacks it); returns how many."""
        for rec in recs:
            self.remove(rec)
        if recs and self.ram is not None:
            self.ram.clear()
        return len(recs)

    def prompt(self, messages, documents=None, retrieve: int | None = None
               ) -> tuple[DocumentPrompt, list[float] | None]:
        """The prompt of ``messages`` (chat messages, or a string as one user turn) with
        ``documents`` (given) or the ``retrieve`` nearest stored ones (:func:`build_prompt`),
        and the retrieval scores (None when given).

        Raises ValueError: both or neither given, a bad document or message, or nothing to retrieve.
        """
        if (documents is None) == (retrieve is None):
            raise ValueError("documents: pass either documents= or retrieve=, not both")
        if isinstance(messages, str):
            check_text(messages, "prompt")
            messages = [{"role": "user", "content": messages}]
        check_messages_text(messages)
        scores = None
        if retrieve is not None:
            if not isinstance(retrieve, int) or isinstance(retrieve, bool) or retrieve < 1:
                raise ValueError(f"retrieve: expected an integer >= 1, got {retrieve!r}")
            question = messages[-1].get("content", "") if messages and isinstance(messages[-1], Mapping) else ""
            if not str(question).strip():
                raise ValueError("retrieve: the last message has no text to retrieve by")
            hits = self.retrieve(str(question), retrieve)
            records_, scores = [r for r, _ in hits], [round(s, 4) for _, s in hits]
        else:
            records_ = [self.record_for(d, i) for i, d in enumerate(as_inputs(documents))]
        return build_prompt(self.adapter, messages, records_), scores

    def store_missing(self, prompt: DocumentPrompt) -> int:
        """Add the prompt's documents whose KV or record the store lacks (their KV computed now:
        the engine's sequence is cleared). Returns how many; a store failure is logged."""
        if self.store is None or self.store.readonly or self.namespace is None:
            return 0
        added = 0
        for rec, _ in prompt.pieces:
            try:
                if self.get(rec.key) is None or not self.kv_stored(rec):
                    self.add(rec)
                    added += 1
            except (StoreError, OSError, ValueError, RuntimeError) as exc:
                log.warning("could not store document %s: %s", rec.doc_id[:16], exc)
        return added


def document_encoder(semantic, backend: str) -> Callable[[list[str]], np.ndarray]:
    """Texts -> float32 ``[n, 384]`` MiniLM embeddings: the semantic lookup's embedder when it
    runs (``semantic``, or None), else the ``backend`` embedder, loaded at first use; raises
    MissingExtraError when it cannot load (the ``semantic`` extra)."""
    loaded = []

    def encode(texts: list[str]) -> np.ndarray:
        if semantic is not None:
            vectors = semantic.encode(texts)
            if vectors is not None:
                return vectors
        if not loaded:
            from edgesync_store.semantic.embedder_base import EmbeddingUnavailableError
            from edgesync_store.semantic.embedders import get_embedder

            try:
                loaded.append(get_embedder(backend).load())
            except EmbeddingUnavailableError as exc:  # documents are embedded for retrieval
                raise MissingExtraError("documents", "semantic", exc.package) from exc
        return loaded[0].encode(texts)

    return encode


class DocumentRequest:
    """A request with documents, around the request's reuse strategy: in ``blend`` mode the
    prompt's missing documents are stored and their KV placed (``request/blend.py``) before
    the answer; otherwise the strategy reuses exact KV and the missing documents are stored
    after the answer (off the TTFT path). The engine's sequence then holds no exact live KV.
    It runs in the engine's first lane, where the library computes documents.
    """

    first_lane = True

    def __init__(self, library: DocumentLibrary, strategy: "ExactReuse | SemanticReuse", prompt: DocumentPrompt,
                 scores: list[float] | None) -> None:
        self.library, self.strategy, self.prompt, self.scores = library, strategy, prompt, scores
        self.blended: "Blended | None" = None
        self.refusal: str | None = None
        self.computed = 0

    def reuse(self, lane, prompt, tokens: list[int], max_tokens: int,
              live_exact: int = 0) -> tuple[ReusePlan, Injection]:
        """Blend (``blend`` mode, documents in the prompt, an engine that can), else the
        strategy's reuse."""
        if self.strategy.mode == ReuseMode.BLEND and self.prompt.pieces:
            self._blend(lane)
        if self.blended is None:
            return self.strategy.reuse(lane, prompt, tokens, max_tokens, live_exact)
        b = self.blended
        return ReusePlan(prompt=tuple(tokens)), Injection(None, tuple(tokens), b.n_past, b.keys, b.bytes_read)

    def _blend(self, lane) -> None:
        es = self.strategy.engine
        self.refusal = lane.adapter.blend_refusal if lane.injector is not None else "no store"
        if self.refusal is not None:
            if not self.library.blend_refusal_logged:
                log.warning("reuse=blend refused, answering exactly: %s", self.refusal)
                self.library.blend_refusal_logged = True
            return
        from edgesync_engines.request.blend import blend

        self.computed = self.library.store_missing(self.prompt)
        self.blended = blend(self.prompt, lane.injector, es.config)

    def after_answer(self, lane, prompt, tokens: list[int], out: list[int], plan: ReusePlan,
                     injected: Injection) -> int:
        """The strategy's store-back, then the missing documents (none after a blend)."""
        if self.blended is not None:
            return 0
        written = self.strategy.after_answer(lane, prompt, tokens, out, plan, injected)
        self.computed = self.library.store_missing(self.prompt)
        return written

    @staticmethod
    def exact_context(injected: Injection) -> bool:
        """False: the documents computed after the answer replaced the engine's sequence."""
        return False

    def annotate(self, result: "GenerationResult") -> None:
        """Fill the documents fields of ``result`` in place (``tokens_reused`` after a blend: exact
        head + blended tokens)."""
        result.documents, result.retrieval_scores = self.prompt.document_ids, self.scores
        result.blend_refusal, result.documents_computed = self.refusal, self.computed
        b = self.blended
        if b is not None:
            result.approximate = True
            result.blended_tokens, result.recomputed_tokens = b.blended_tokens, b.recomputed_tokens
            result.tokens_reused = b.head_reused + b.blended_tokens
            result.tokens_prefilled = result.prompt_tokens - result.tokens_reused
            result.hit = hit_kind(result.tokens_reused, result.prompt_tokens)
