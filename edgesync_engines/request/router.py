"""The ``EdgeSync`` facade: the object applications use.

``EdgeSync(model, store, config).generate(prompt_or_messages)`` answers a prompt (chat messages
are rendered with the GGUF's own template) in four steps:

1. :func:`~edgesync_engines.request.plan.plan_reuse` decides what the request reuses (that
   module holds the rules).
2. :class:`~edgesync_engines.request.execute.Injector` pins, fetches (through the RAM tier),
   converts and injects that KV.
3. The adapter prefills the rest and generates.
4. :mod:`~edgesync_engines.request.storeback` stores the prompt's missing chunks with its donor
   record, and records the hits; the prefetcher (``prefetch=True``) predicts the next requests.

In the default mode only token-identical KV is injected, so the output equals an uncached
run's. A request whose context holds KV that is not its own (a donor served whole, converted
KV) stores nothing.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from edgesync_engines.adapters.compat import compatible_with
from edgesync_engines.adapters.protocol import ContextOverflowError
from edgesync_engines.config import MAX_SEED, EdgeSyncConfig
from edgesync_engines.request import storeback
from edgesync_engines.request.blend import Blended, blend
from edgesync_engines.request.documents import DocumentLibrary, DocumentPrompt, as_inputs, build_prompt
from edgesync_engines.request.execute import Injection, Injector
from edgesync_engines.request.idle import IdleRunner, PrefillJob, PrepareResult
from edgesync_engines.request.loading import adapter_for, open_store, warm_up
from edgesync_engines.request.plan import ReuseMode, ReusePlan, hit_kind, plan_reuse
from edgesync_engines.request.prefetch import ram_tiers, request_key
from edgesync_engines.request.remote_open import with_remote_tier
from edgesync_engines.request.result import GenerationResult, GenerationStream, StopDecoding
from edgesync_engines.request.semantic_lookup import SemanticLookup
from edgesync_engines.request.stops import StopScanner
from edgesync_store import check
from edgesync_store.core.backend import FragmentBackend
from edgesync_store.documents.records import DocumentRecord
from edgesync_store.errors import MissingExtraError, StoreError
from edgesync_store.lifecycle.jobs import StoreJobs
from edgesync_store.schema import MIN_SPAN, common_prefix_len

log = logging.getLogger(__name__)

NEXT_TURN_PROBES = ("A", "B")
"""Two contents of a user turn that differ in their first letter, so that the tokens of two
renderings part where the content begins (a tokenizer that joins a leading space or a newline to
a word's first letter joins it to either), as they would for a real message starting with a
letter (:meth:`EdgeSync.history_tokens`)."""


def _shown(value, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters, for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_text(text: str, name: str) -> None:
    """A string the tokenizer can encode: no lone surrogate (such as ``"\\ud800"``, which
    UTF-8 cannot encode).

    Raises:
        ValueError: naming ``name`` and where the lone surrogate is.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: must be valid Unicode text, got a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None


def check_chat_messages(messages) -> None:
    """Chat messages: a non-empty list (or tuple) of dicts with string ``role`` and ``content``
    (valid Unicode text: :func:`check_text`), not all blank. Any role is accepted: a chat
    template may know roles such as ``tool``.

    Raises:
        ValueError: naming what is wrong.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"prompt: chat messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("prompt: no chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"prompt: messages[{i}] must be a dict with string 'role' and 'content'")
        check_text(m["role"], f"prompt: messages[{i}] role")
        check_text(m["content"], f"prompt: messages[{i}] content")
    if all(not m["content"].strip() for m in messages):
        raise ValueError("prompt: every chat message is empty")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_sampling(max_tokens, temperature, top_p, seed, stop) -> tuple[int, float, float, int, list[str]]:
    """:meth:`EdgeSync.generate`'s sampling arguments (defaults filled in), checked and returned
    as plain values (``max_tokens``, ``temperature``, ``top_p``, ``seed``, and ``stop`` as a
    list).

    ``max_tokens`` is an int >= 1, ``temperature`` a finite number >= 0, ``top_p`` a number in
    (0, 1], ``seed`` an int in 0..4294967294 (``config.MAX_SEED``: the seeds llama.cpp takes as
    themselves); a bool is neither an int nor a number here (as in the HTTP server's strict
    schema). ``stop`` is None, a string, or a list or tuple of strings, any number of them (the
    HTTP server, as OpenAI's API, takes at most 4).

    Raises:
        ValueError: naming the argument, what it must be and the value given.
    """
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens: must be an int >= 1, got {_shown(max_tokens)}")
    if not _is_number(temperature) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature: must be a finite number >= 0, got {_shown(temperature)}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be a number in (0, 1], got {_shown(top_p)}")
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed: must be an int in 0..{MAX_SEED}, got {_shown(seed)}")
    if stop is None or isinstance(stop, str):
        stops = [] if stop is None else [stop]
        if stop is not None:
            check_text(stop, "stop")
    elif isinstance(stop, (list, tuple)):
        stops = list(stop)
        for i, s in enumerate(stops):
            if not isinstance(s, str):
                raise ValueError(f"stop[{i}]: must be a string, got {_shown(s)}")
            check_text(s, f"stop[{i}]")
    else:
        raise ValueError(f"stop: must be a string or a list of strings, got {_shown(stop)}")
    return int(max_tokens), float(temperature), float(top_p), int(seed), stops


class EdgeSync:
    """A llama.cpp or ONNX Runtime model with a persistent KV fragment cache in front of its
    prefill.

    Args:
        model: a GGUF path, a ``llama_cpp.Llama``, None for the configured model
            (SmolLM2-135M-Instruct by default), or any object implementing
            :class:`~edgesync_engines.adapters.protocol.EngineAdapter` (such as
            :class:`LlamaCppAdapter`, :class:`OnnxRuntimeAdapter`, or a test's fake), which
            ``close`` leaves open. With ``config.engine == "onnx"`` a GGUF path means its ONNX
            export (``edgesync export-onnx``).
        store: a storage backend (:class:`FragmentBackend`; the local one is
            :class:`FragmentStore`), a store directory, None for the configured store, or False
            for no cache at all (every request prefills from scratch). An engine whose KV cannot
            be cut (``adapter.cache_refusal``) is served without the store, each result's
            ``uncached_reason`` saying why.
        config: settings (default: :meth:`EdgeSyncConfig.load`, i.e. defaults < environment).

    Thread safety: one request at a time drives the engine (the adapter's lock); a stream holds
    it until it is read to the end or closed, so another thread's call waits, and a call from
    the stream's own thread that would drive the engine (``generate``, ``prepare``,
    ``add_documents``, ``make_room``) raises RuntimeError.

    Chat turns (``config.idle_store``, off by default in the Python API, on in ``edgesync
    serve``): after each answer to chat messages, a background thread prefills the conversation
    with that answer, as the next turn's prompt begins, and stores its KV (``request/idle.py``).
    It holds the adapter's lock one batch (``idle_batch_tokens``) at a time: a ``generate`` call
    pauses it and waits for one batch at most; code that drives ``adapter`` directly must take
    ``adapter.lock`` too. With it on, a request that extends the engine's live sequence (exact
    KV of a previous prompt or of idle-time work) continues it and injects nothing.
    :meth:`prepare` does the same work at once, for any prompt.

    Documents (strings or dicts placed before a question, their KV computed once): see
    :meth:`add_documents` and ``generate(documents=..., retrieve=...)``.

    Raises:
        TypeError: ``model`` is not a path, a ``llama_cpp.Llama`` or an engine adapter (the
            missing protocol members are named), or ``store`` is not a backend, path, None or
            False.
        onnx_export.ExportError: ``config.engine == "onnx"`` and the GGUF has no sound ONNX
            export.
    """

    def __init__(self, model=None, store: "FragmentBackend | str | os.PathLike | None | bool" = None,
                 config: EdgeSyncConfig | None = None) -> None:
        self.config = config or EdgeSyncConfig.load()
        if self.config.cache_enabled and (store is None or isinstance(store, (str, os.PathLike))):
            # the store's page check runs in a child while the model loads; open_store waits for it
            check.begin(Path(store or self.config.store_path))
        self.adapter, self._owns_adapter = adapter_for(model, self.config)
        self._owns_store = False
        self.uncached_reason = None
        self._library: DocumentLibrary | None = None  # made at first use
        self._doc_embedder = None  # MiniLM loaded for documents when the semantic lookup has none
        self._blend_refusal_logged = False
        if store is False or not self.config.cache_enabled:
            self.store = None
        elif self.adapter.cache_refusal is not None:
            # KV we cannot cut: the store is neither opened nor read nor written
            self.store = None
            self.uncached_reason = self.adapter.cache_refusal
        elif isinstance(store, FragmentBackend):
            self.store = store
        elif store is not None and not isinstance(store, (str, os.PathLike)):
            raise TypeError(f"store: expected a FragmentBackend (e.g. a FragmentStore), a path, None or False, "
                            f"got {type(store).__name__}")
        else:
            # with the shared remote tier in front, when configured
            self.store = with_remote_tier(open_store(Path(store or self.config.store_path), self.config), self.config)
            self._owns_store = self.store is not None
        self.semantic = None
        if self.store is not None and self.config.semantic:
            self.semantic = SemanticLookup(self.store, self.config)  # loads nothing until first needed
            if self.config.reuse == ReuseMode.SEMANTIC:
                self.semantic.warm_up()
        # the RAM tier of decoded fragments (read through by the injector) and its prefetcher
        self.fragment_cache, self.prefetcher = (None, None) if self.store is None else ram_tiers(
            self.store, self.adapter, self.config)
        self._injector = None if self.store is None else Injector(self.store, self.adapter, self.fragment_cache)
        warm_up(self.adapter, self.store)  # the first request's one-time work and a rehearsal, at load
        self.idle = IdleRunner(self.adapter.lock)
        self._live_exact = 0  # leading live tokens whose KV equals an uncached prefill's ...
        self._live_epoch = -1  # ... while the adapter's kv_epoch is this one
        self._prepared: list[int] | None = None  # the last idle-time job's tokens, until a request
        self._driving: int | None = None  # the thread whose request holds the engine (between a stream's pieces)
        self.jobs = None
        if self.store is not None and not self.store.readonly and self.config.jobs:
            self.jobs = StoreJobs(self.store, self._semantic_index, self.config.sweep_interval_s,
                                  self.config.compact_interval_s).start()

    def _semantic_index(self):
        """The semantic lookup's open index once loaded (for the store jobs), else None."""
        return self.semantic.index_if_ready() if self.semantic is not None else None

    def forget(self, prompt: "str | Sequence[dict]", documents: "Sequence[str | dict] | None" = None) -> int:
        """Remove every fragment this prompt wrote or would hit: at each position of its
        tokens, the stored fragments (any chunk size, layer or head group, live or expired)
        that follow its prefix and start with its next token, written by this engine or by
        another engine for the same model, with their donor records and vectors; the RAM tier
        is emptied. With ``documents`` the prompt is the documents prompt, and those documents are removed
        too. Afterwards the same request is a miss. Returns the fragments removed.

        Raises:
            ValueError: an empty prompt or malformed chat messages.
            PermissionError: the store is open read-only.
            StoreError: the store could not be written.
        """
        self._check_open()
        tokens = self.prompt_tokens(prompt) if documents is None else list(
            self.document_prompt(prompt, documents)[0].tokens)
        if self.store is None:
            return 0
        if documents is not None:
            self._forget_documents(documents)
        # every engine's copy: KV another engine wrote for this model would still serve it
        # with allow_convertible
        namespaces = {self.namespace}
        namespaces |= {ns for ns in self.store.namespaces() if compatible_with(ns, self.namespace).usable}
        removed = sum(self.store.forget_tokens(ns, tokens) for ns in namespaces)
        if self.fragment_cache is not None:
            self.fragment_cache.clear()  # decoded KV of this prompt may sit there
        log.info("forgot %d fragments of a %d-token prompt", removed, len(tokens))
        return removed

    # -- documents ------------------------------------------------------------------------------

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
            from edgesync_store.semantic.embedder_base import EmbeddingUnavailableError
            from edgesync_store.semantic.embedders import get_embedder

            try:
                self._doc_embedder = get_embedder(self.config.embedding_backend).load()
            except EmbeddingUnavailableError as exc:  # documents are embedded for retrieval
                raise MissingExtraError("documents", "semantic", exc.package) from exc
        return self._doc_embedder.encode(texts)

    def add_documents(self, documents: Iterable["str | Mapping"],
                      progress: Callable[[int], None] | None = None) -> list[DocumentRecord]:
        """Store documents: each one's KV computed once (standalone, only when its chain is not
        stored yet), its record, and its text embedded for retrieval (without the ``semantic``
        extra: not embedded, with a warning; ``retrieve=`` embeds it once the extra is there).
        ``documents`` are strings or dicts with ``text`` (or ``context``) and optional ``title``,
        ``source``; ``progress(i)`` is called after each. Returns the records, in order.

        Raises:
            ValueError: a document that is empty, malformed or longer than the context (nothing
                is stored for it or after it), or no store (``store=False``).
            PermissionError: the store is read-only.
            StoreError: the store could not be written.
            RuntimeError: the engine is closed, or a stream of the calling thread still holds it.
        """
        self._check_not_streaming()
        if self.store is None or self.adapter.namespace is None:
            raise ValueError("add_documents: needs a store and an engine whose KV can be cached "
                             f"({self.uncached_reason or 'store=False or EDGESYNC_CACHE=0'})")
        inputs = as_inputs(documents)
        out = []
        with self.idle.paused(), self.adapter.lock:
            self._live_exact = 0  # documents are computed in the engine's sequence
            for i, doc in enumerate(inputs):
                out.append(self.documents.add(self.documents.record_for(doc, i)))
                if progress is not None:
                    progress(i + 1)
        return out

    def list_documents(self) -> list[DocumentRecord]:
        """The stored documents of this engine's namespace.

        Raises:
            RuntimeError: the engine is closed.
        """
        self._check_open()
        return self.documents.list()

    def remove_documents(self, ids: Iterable["str | DocumentRecord"]) -> int:
        """Remove documents (their IDs, unique ID prefixes of 8+ hex digits, or records) with
        their fragments; the next request with them recomputes them. Returns the documents
        removed.

        Raises:
            KeyError: an ID that names no stored document (or several).
            StoreError: the store could not be written.
        """
        self._check_open()
        if isinstance(ids, (str, DocumentRecord)):
            ids = [ids]  # one ID, not its characters
        found = []
        for doc_id in ids:
            rec = doc_id if isinstance(doc_id, DocumentRecord) else self.documents.resolve(str(doc_id))
            if rec is None:
                raise KeyError(f"no stored document matches {doc_id!r}: unknown, under 8 hex digits, or a prefix "
                               f"of several (give more digits)")
            found.append(rec)
        return self._remove_records(found)

    def _forget_documents(self, documents: Iterable["str | Mapping"]) -> int:
        """Remove the given documents (as passed to ``generate``) if stored; returns how many."""
        recs = [self.documents.record_for(d, i) for i, d in enumerate(as_inputs(documents))]
        return self._remove_records([r for r in recs if self.documents.get(r.key) is not None])

    def _remove_records(self, recs: list[DocumentRecord]) -> int:
        """Remove stored documents and empty the RAM tier, which may hold a copy of their KV
        (never served once the store lacks it); returns how many."""
        for rec in recs:
            self.documents.remove(rec)
        if recs and self.fragment_cache is not None:
            self.fragment_cache.clear()
        return len(recs)

    def document_prompt(self, messages: Sequence[Mapping[str, str]], documents=None,
                        retrieve: int | None = None) -> tuple[DocumentPrompt, list[float] | None]:
        """The prompt of ``messages`` with ``documents`` (given) or the ``retrieve`` nearest
        stored ones (:func:`~edgesync_engines.request.documents.build_prompt`), and the
        retrieval scores (None when given).

        Raises:
            ValueError: both or neither given, a bad document, messages not ending with a user
                turn, text with a lone surrogate (:func:`check_text`), or ``retrieve`` with no
                stored documents.
        """
        self._check_open()
        if (documents is None) == (retrieve is None):
            raise ValueError("documents: pass either documents= or retrieve=, not both")
        if isinstance(messages, str):
            check_text(messages, "prompt")
            messages = [{"role": "user", "content": messages}]
        for i, m in enumerate(messages if isinstance(messages, (list, tuple)) else ()):
            for key in ("role", "content"):
                if isinstance(m, Mapping) and isinstance(m.get(key), str):
                    check_text(m[key], f"prompt: messages[{i}] {key}")
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

    def _store_missing_documents(self, prompt: DocumentPrompt) -> int:
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

    def _blend_documents(self, doc_prompt: DocumentPrompt, injector) -> "tuple[Blended | None, str | None, int]":
        """Store the prompt's missing documents and blend it (``request/blend.py``) with
        ``injector`` (None: no store); returns (what the engine holds, None, documents
        computed), or (None, why not, 0) when the engine cannot blend (logged once)."""
        refusal = self.adapter.blend_refusal if injector is not None else "no store"
        if refusal is not None:
            if not self._blend_refusal_logged:
                log.warning("reuse=blend refused, answering exactly: %s", refusal)
                self._blend_refusal_logged = True
            return None, refusal, 0
        computed = self._store_missing_documents(doc_prompt)
        return blend(doc_prompt, injector, self.config), None, computed

    @staticmethod
    def _annotate_documents(result: GenerationResult, prompt: DocumentPrompt, scores: list[float] | None,
                            blended: "Blended | None", refusal: str | None, computed: int) -> None:
        """Fill a documents request's fields of its ``GenerationResult`` (in place): the document
        IDs and retrieval scores, why a blend was refused, the documents computed, and for a blend
        the approximate flag, the blended and recomputed counts and what they make of
        ``tokens_reused`` (exact head + blended tokens), ``tokens_prefilled`` and the hit kind."""
        result.documents, result.retrieval_scores = prompt.document_ids, scores
        result.blend_refusal, result.documents_computed = refusal, computed
        if blended is not None:
            result.approximate = True
            result.blended_tokens, result.recomputed_tokens = blended.blended_tokens, blended.recomputed_tokens
            result.tokens_reused = blended.head_reused + blended.blended_tokens
            result.tokens_prefilled = result.prompt_tokens - result.tokens_reused
            result.hit = hit_kind(result.tokens_reused, result.prompt_tokens)

    namespace = property(lambda self: self.adapter.namespace, doc="The engine's KV namespace.")

    def prefetch_stats(self) -> dict | None:
        """Prefetch counters (:meth:`Prefetcher.stats`), or None when prefetch is off."""
        return None if self.prefetcher is None else self.prefetcher.stats()

    def prompt_tokens(self, prompt: "str | Sequence[dict]", add_generation_prompt: bool = True) -> list[int]:
        """Token IDs of a raw prompt string, or of chat messages rendered with the chat template
        (ending with the assistant prompt unless ``add_generation_prompt`` is False).

        Raises:
            ValueError: a blank prompt, no messages, malformed messages, messages whose contents
                are all blank, or text with a lone surrogate (not valid Unicode).
            RuntimeError: the engine is closed.
        """
        self._check_open()
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt: is empty")
            check_text(prompt, "prompt")
            text = prompt
        else:
            check_chat_messages(prompt)
            text = self.adapter.apply_chat_template(prompt, add_generation_prompt)
        return self.adapter.tokenize(text)

    def history_tokens(self, messages: "str | Sequence[dict]") -> list[int]:
        """Token IDs the next prompt of a conversation that ends with ``messages`` begins
        with: the chat template over them, and, when the last message is an answer or a system
        prompt, the beginning of the user turn that follows (rendered twice, with the
        :data:`NEXT_TURN_PROBES` as that turn's content: the tokens the two renderings share).
        The next request renders the history as an earlier turn, as this does (some templates
        render a last answer otherwise, e.g. drop its reasoning only when a user turn follows).
        A template that refuses the probe turn gives the history without a generation prompt,
        as does a conversation that ends otherwise; a string is tokenized as is.

        Raises:
            ValueError, RuntimeError: as :meth:`prompt_tokens`.
        """
        if not isinstance(messages, str):
            check_chat_messages(messages)
            if messages[-1]["role"] in ("assistant", "system"):
                try:
                    a, b = (self.prompt_tokens([*messages, {"role": "user", "content": probe}],
                                               add_generation_prompt=False) for probe in NEXT_TURN_PROBES)
                except Exception as e:  # a template may raise on any turn order (jinja's raise_exception)
                    log.debug("history_tokens: the template refused a user turn after the history (%s)", e)
                else:
                    if common := common_prefix_len(a, b):
                        return a[:common]
        return self.prompt_tokens(messages, add_generation_prompt=False)

    def generate(
        self,
        prompt: "str | Sequence[dict]",
        max_tokens: int | None = None,
        stream: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        documents: "Sequence[str | dict] | None" = None,
        retrieve: int | None = None,
        reuse: str | None = None,
        stop: "Sequence[str] | str | None" = None,
    ) -> "GenerationResult | GenerationStream":
        """Answer a prompt (a string used as is, or chat messages), reusing stored KV.

        ``documents`` (strings or dicts with ``text``) or ``retrieve=k`` (the k stored documents
        nearest to the last user turn) go before the question (``request/documents.py``);
        ``reuse`` overrides ``config.reuse``: ``"blend"`` places their stored KV (approximate,
        ``request/blend.py``); otherwise only token-identical KV is injected. Decoding ends at
        the first of the ``stop`` strings (not part of the text), at an end-of-generation token,
        at ``max_tokens``, or when the caller stops the stream (:meth:`GenerationStream.stop`,
        or closing it); the prompt is stored in every case. ``stop`` is a string or a list (or
        tuple) of strings, any number of them (the HTTP server takes at most 4).

        Returns a :class:`GenerationResult`, or with ``stream=True`` a
        :class:`GenerationStream` of text pieces whose ``result`` is set once exhausted.

        Raises:
            ContextOverflowError: prompt tokens + max_tokens exceed the context (no engine
                work is done).
            ValueError: naming the argument: an empty prompt, malformed chat messages, a prompt
                with a lone surrogate (not valid Unicode text), ``max_tokens`` not an int >= 1,
                ``temperature`` not a finite number >= 0, ``top_p`` not a number in (0, 1],
                ``seed`` not an int in 0..``config.MAX_SEED`` (a bool is refused for each:
                :func:`check_sampling`),
                ``stop`` not a string or a list of strings, a bad document, an unknown
                ``reuse``, or ``retrieve`` on a store without documents. No engine work is done.
            RuntimeError: the engine is closed, or a stream of the calling thread still holds
                it (read it to the end or close it first).
        """
        self._check_not_streaming()
        if not isinstance(stream, bool):
            raise ValueError(f"stream: must be True or False, got {_shown(stream)}")
        cfg = self.config
        mode = cfg.reuse if reuse is None else reuse
        if mode not in (ReuseMode.EXACT, ReuseMode.SEMANTIC, ReuseMode.BLEND):
            raise ValueError(f"reuse: {mode!r} is not one of exact, semantic, blend")
        max_tokens, temperature, top_p, seed, stops = check_sampling(
            cfg.max_tokens if max_tokens is None else max_tokens,
            cfg.temperature if temperature is None else temperature,
            cfg.top_p if top_p is None else top_p,
            cfg.seed if seed is None else seed,
            stop,
        )
        docs = None
        if documents is not None or retrieve is not None:
            docs = self.document_prompt(prompt, documents, retrieve)
        events = self._run(prompt, max_tokens, temperature, top_p, seed, docs, mode, stops)
        stream_obj = GenerationStream.start(events)
        if stream:
            return stream_obj
        for _ in stream_obj:
            pass
        return stream_obj.result

    def _run(self, prompt, max_tokens: int, temperature: float, top_p: float, seed: int, docs=None, mode="exact",
             stop: Sequence[str] = ()):
        """The request as a generator: "" once the input is checked, then the text pieces,
        then the :class:`GenerationResult`; :class:`StopDecoding` thrown at a piece ends
        decoding there."""
        t0 = time.perf_counter()
        doc_prompt = docs[0] if docs is not None else None
        tokens = self._checked_tokens(prompt, max_tokens, None if doc_prompt is None else list(doc_prompt.tokens))
        yield ""  # input checked: errors above raise from generate() itself
        t_wait, progress = time.perf_counter(), self.idle.progress()
        # idle-time work stops during its current batch, and starts none until this request is done
        with self._engine_turn() as idle_busy:
            self._check_open()  # a stream begun before close() and read after it
            idle_wait_ms = (time.perf_counter() - t_wait) * 1000 if idle_busy else None
            idle_wait_tokens = self.idle.progress() - progress if idle_busy else 0
            live_exact = self._take_live(tokens)
            blended, refusal, computed = None, None, 0
            if doc_prompt is not None and mode == ReuseMode.BLEND and doc_prompt.pieces:
                blended, refusal, computed = self._blend_documents(doc_prompt, self._injector)
            if blended is not None:
                plan = ReusePlan(prompt=tuple(tokens))
                injected = Injection(None, tuple(tokens), blended.n_past, blended.keys, blended.bytes_read)
            else:
                # with idle-time storing, a request that extends the live sequence continues it
                plan, injected = self._reuse(prompt, tokens, max_tokens, mode,
                                             live_exact if self.config.idle_store else 0)
            out: list[int] = []
            decoded = yield from self._decode(tokens, injected, max_tokens, temperature, top_p, seed, stop, out, t0)
            text, ttft_ms, finish = decoded
            exact_context = blended is None and not (injected.approximate or injected.convertible)
            written = 0 if blended is not None else self._after_answer(prompt, tokens, out, plan, injected)
            self._live_exact = len(tokens) - 1 if exact_context else 0
            self._live_epoch = self.adapter.kv_epoch
            if doc_prompt is not None and blended is None:
                computed = self._store_missing_documents(doc_prompt)  # after the answer: off the TTFT path
                self._live_exact = 0  # documents computed in the engine's sequence
        result = self._result(tokens, out, text, plan, injected, written, ttft_ms, (time.perf_counter() - t0) * 1000)
        result.finish_reason, result.idle_wait_ms, result.idle_wait_tokens = finish, idle_wait_ms, idle_wait_tokens
        if doc_prompt is not None:
            self._annotate_documents(result, doc_prompt, docs[1], blended, refusal, computed)
        elif exact_context and self.config.idle_store and not isinstance(prompt, str) and finish != "cancelled":
            self.prepare_later(list(prompt) + [{"role": "assistant", "content": result.text}])
        yield result

    def _decode(self, tokens: list[int], injected: Injection, max_tokens: int, temperature: float, top_p: float,
                seed: int, stop: Sequence[str], out: list[int], t0: float):
        """Prefill the rest of the prompt and decode into ``out``, yielding the text pieces
        (stop strings cut, ``request/stops.py``); returns (text, TTFT in ms, finish reason:
        ``stop``, ``length`` or ``cancelled``)."""
        decoder, scanner = self.adapter.text_stream(), StopScanner(stop)
        pieces: list[str] = []
        ttft_ms, cancelled = None, False
        steps = self.adapter.generate(list(injected.tokens), injected.reused, max_tokens, temperature, top_p, seed)
        try:
            for token in steps:
                if ttft_ms is None:
                    ttft_ms = (time.perf_counter() - t0) * 1000
                out.append(token)
                # bytes of a character cut by max_tokens stay out of the text (no trailing U+FFFD)
                piece = scanner.feed(decoder.decode(self.adapter.token_bytes(token)))
                if len(out) == 1 and injected.keys:
                    storeback.record_hits(self.store, injected.keys, self._reused(injected))
                if piece:
                    pieces.append(piece)
                    try:
                        yield piece
                    except StopDecoding:
                        cancelled = True
                if cancelled or scanner.stopped:
                    break
        finally:
            steps.close()
        tail = "" if cancelled else scanner.flush()
        if tail:
            pieces.append(tail)
            try:
                yield tail
            except StopDecoding:
                cancelled = True
        if ttft_ms is None:
            ttft_ms = (time.perf_counter() - t0) * 1000
            if injected.keys:
                storeback.record_hits(self.store, injected.keys, self._reused(injected))
        finish = "cancelled" if cancelled else "length" if len(out) >= max_tokens and not scanner.stopped else "stop"
        return "".join(pieces), ttft_ms, finish

    # -- the live sequence and idle-time work ------------------------------------------------

    def _take_live(self, tokens: list[int]) -> int:
        """For a request of ``tokens`` (lock held): the count of exact live tokens, which the
        request then owns, and the idle-time tokens it makes wasted (counted)."""
        live_exact = self._live_exact if self._live_epoch == self.adapter.kv_epoch else 0
        self._live_exact = 0
        if self._prepared is not None:
            (prepared, start), self._prepared = self._prepared, None
            common = common_prefix_len(prepared, tokens)
            if common >= start:  # the same conversation, departing inside the prepared tokens
                self.idle.stats.tokens_wasted += len(prepared) - common
        return live_exact

    def _live_prefix(self, tokens: list[int], live_exact: int) -> int:
        """Tokens of ``tokens`` the live sequence holds with exact KV, cut to an injection
        point (``usable_prefix``). No lower bound: a short shared beginning (a chat template's
        default system part) is worth continuing too, since nothing is read to use it."""
        if live_exact < 1:
            return 0
        common = common_prefix_len(self.adapter.live_tokens()[:live_exact], tokens)
        return max(0, self.adapter.usable_prefix(common, len(tokens)))

    def prepare(self, prompt: "str | Sequence[dict]") -> PrepareResult:
        """Store a prompt's KV without answering it, so that a later request that begins with
        it prefills only the rest. Chat messages are rendered as the next turn begins
        (:meth:`history_tokens`: the chat template, and after a system prompt alone or an
        answer the beginning of the next user turn); a string is used as is. What the store or the
        engine's live sequence already holds is reused; the rest is prefilled in small exact
        batches (``idle_batch_tokens``) and stored chunk by chunk. Useful to warm a system
        prompt or a document when an app installs. Waits for the engine's lock.

        Raises:
            ValueError: an empty prompt, malformed messages, or no store (``store=False``, or
                an engine whose KV cannot be cached).
            PermissionError: the store is read-only.
            ContextOverflowError: the prompt is longer than the context.
            RuntimeError: the engine is closed, or a stream of the calling thread still holds
                it (read it to the end or close it first).
        """
        self._check_not_streaming()
        if self.store is None or self.adapter.namespace is None:
            raise ValueError("prepare: needs a store and an engine whose KV can be cached "
                             f"({self.uncached_reason or 'store=False or EDGESYNC_CACHE=0'})")
        if self.store.readonly:
            raise PermissionError("prepare: the store is open read-only")
        tokens = self.history_tokens(prompt)
        if len(tokens) > self.adapter.n_ctx:
            raise ContextOverflowError(len(tokens), 0, self.adapter.n_ctx)
        with self.idle.paused(), self.adapter.lock:
            return self._prefill_job(prompt, tokens).run()

    def make_room(self, n_tokens: int, should_stop: Callable[[], bool] | None = None) -> bool:
        """Idle-time work: make room now for injecting a stored prompt of ``n_tokens`` tokens
        later (``EngineAdapter.make_room``), so that the request that injects it does not
        allocate memory on its path; the live sequence stays. Nothing without a store. Waits
        for the engine's lock; ``should_stop`` is asked as it goes, and once it returns True
        nothing is kept. Returns True when the room is there.

        Raises:
            RuntimeError: the engine is closed, or a stream of the calling thread still holds
                it (read it to the end or close it first).
        """
        self._check_not_streaming()
        if self.store is None:
            return True
        with self.adapter.lock:
            return self.adapter.make_room(n_tokens, should_stop)

    def prepare_later(self, history: "Sequence[dict]") -> None:
        """Queue :meth:`prepare` of chat messages (e.g. a conversation that ends with an answer,
        given by another engine) as idle-time work (:attr:`idle`): it runs while no request needs
        the engine, and the engine then holds it live. Nothing happens without a writable store
        or an engine whose KV can be cached.

        Raises:
            ValueError: not a list of chat messages, as :meth:`prompt_tokens` checks them.
            RuntimeError: the engine is closed.
        """
        self._check_open()
        check_chat_messages(history)
        if self.store is None or self.store.readonly or self.adapter.namespace is None:
            return
        history = list(history)

        def start() -> PrefillJob | None:
            tokens = self.history_tokens(history)
            return self._prefill_job(history, tokens) if len(tokens) < self.adapter.n_ctx else None

        self.idle.submit(start, key=tuple((m.get("role"), m.get("content")) for m in history))

    def _prefill_job(self, prompt, tokens: list[int]) -> PrefillJob:
        """The :class:`PrefillJob` of ``tokens`` (lock held), starting from what the live
        sequence or the store holds exactly."""
        live_exact = self._live_exact if self._live_epoch == self.adapter.kv_epoch else 0
        self._live_exact = 0
        _, injected = self._reuse(prompt, tokens, 1, ReuseMode.EXACT, live_exact)
        start = 0 if injected.approximate or injected.convertible else injected.reused
        self._live_exact, self._live_epoch = start, self.adapter.kv_epoch

        def ready(end: int) -> None:
            self._live_exact, self._live_epoch = end, self.adapter.kv_epoch
            self._prepared = (tokens[:end], start)

        return PrefillJob(self.adapter, self.store, self.config, tokens, start, self.fragment_cache, ready)

    def _reused(self, injected: Injection) -> tuple[bytes, tuple[int, ...]] | None:
        """The reuse hint a hit leaves (namespace digest, tokens injected), or None: a donor's or
        another engine's KV is not this prompt's to rehearse."""
        if injected.approximate or injected.convertible:
            return None
        return self.namespace.digest(), injected.tokens[:injected.reused]

    def _checked_tokens(self, prompt, max_tokens: int, tokens: list[int] | None = None) -> list[int]:
        """The prompt's tokens (``tokens`` when already built) once the request is checked
        (see :meth:`generate`'s errors; the sampling arguments were checked by
        :func:`check_sampling`)."""
        self._check_open()
        tokens = self.prompt_tokens(prompt) if tokens is None else tokens
        if not tokens:
            raise ValueError("prompt: tokenizes to nothing")
        if len(tokens) + max_tokens > self.adapter.n_ctx:
            raise ContextOverflowError(len(tokens), max_tokens, self.adapter.n_ctx)
        return tokens

    def _check_open(self) -> None:
        if self.adapter.closed:
            raise RuntimeError("EdgeSync: the engine is closed")

    def _check_not_streaming(self) -> None:
        """Refuse a call that drives the engine from the thread whose stream holds it: the
        adapter's lock is re-entrant, so the call would run between the stream's pieces and
        change the sequence the stream decodes (another thread waits for the lock instead)."""
        self._check_open()
        if self._driving == threading.get_ident():
            raise RuntimeError("EdgeSync: a stream of this thread still holds the engine: read it to the "
                               "end or close it before the next call")

    @contextmanager
    def _engine_turn(self) -> Iterator[bool]:
        """Hold the engine for one request: idle-time work paused (yields whether it was busy)
        and the adapter's lock taken, this thread marked as driving it until the end."""
        with self.idle.paused() as idle_busy, self.adapter.lock:
            self._driving = threading.get_ident()
            try:
                yield idle_busy
            finally:
                self._driving = None

    def _reuse(self, prompt, tokens: list[int], max_tokens: int, mode: str,
               live_exact: int = 0) -> tuple[ReusePlan, Injection]:
        """Plan what the request reuses in ``mode`` and inject it (the caller holds the adapter's
        lock); in the exact mode, when the live sequence's first ``live_exact`` tokens (exact
        KV) give at least what the store would, inject nothing and continue them."""
        mode = ReuseMode.EXACT if mode == ReuseMode.BLEND else mode  # blend concerns documents only
        config = self.config if mode == self.config.reuse else replace(self.config, reuse=mode)
        plan = plan_reuse(prompt, tokens, max_tokens, store=self.store, adapter=self.adapter,
                          config=config, semantic=self.semantic)
        for key in plan.stale_donors:
            self.semantic.forget(key)
        if self._injector is None:
            return plan, Injection(None, plan.prompt)
        live = self._live_prefix(tokens, live_exact) if mode == ReuseMode.EXACT else 0
        n = len(tokens)
        stored = max((self.adapter.usable_prefix(min(source.match.matched_tokens, source.limit), n)
                      for source in plan.sources if source.tokens == plan.prompt), default=0)
        if stored < MIN_SPAN:  # the injector injects nothing shorter
            stored = 0
        if live and live >= stored:
            return plan, Injection(None, tuple(tokens), live, live=True)
        return plan, self._injector.carry_out(plan)

    def _after_answer(self, prompt, tokens: list[int], out: list[int], plan: ReusePlan,
                      injected: Injection) -> int:
        """Store back (with the donor record), index, feed the prefetcher; returns fragments written."""
        written = 0
        # the context holds a donor's or another engine's KV: nothing to store
        if self.store is not None and not (injected.approximate or injected.convertible):
            donor = None if self.semantic is None else prompt
            written = storeback.store_new(self.store, self.adapter, tokens, self.config, donor, self.fragment_cache)
            if self.semantic is not None:
                storeback.index_prompt(self.semantic, self.store, self.namespace, prompt, tokens, plan.embedded,
                                       self.config)
        if self.prefetcher is not None:
            key = request_key(self.namespace, tokens, self.config.chunk_tokens)
            self.prefetcher.after_request(key, tokens + out)
        return written

    def _result(self, tokens: list[int], out: list[int], text: str, plan: ReusePlan, injected: Injection,
                written: int, ttft_ms: float, total_ms: float) -> GenerationResult:
        """The request's :class:`GenerationResult` (and its log line)."""
        n, reused = len(tokens), injected.reused
        hit = hit_kind(reused, n, injected.approximate)
        lookup_ms = None if plan.lookup_ms is None else plan.lookup_ms + injected.donor_ms
        result = GenerationResult(
            text=text,
            tokens=out,
            hit=hit,
            similarity=plan.similarity,
            prompt_tokens=n,
            tokens_reused=reused,
            tokens_prefilled=len(injected.tokens) - reused,
            ttft_ms=ttft_ms,
            total_ms=total_ms,
            bytes_read=injected.bytes_read,
            fragments_written=written,
            approximate=injected.approximate,
            lookup_ms=lookup_ms,
            donor=injected.donor,
            ram_tier_hits=injected.ram_tier_hits,
            convertible=injected.convertible,
            source_engine=injected.source_engine,
            uncached_reason=self.uncached_reason,
            live_tokens=injected.reused if injected.live else 0,
        )
        log.info("request: %d prompt tokens, hit %s%s, reused %d, similarity %s, ttft %.1f ms", n, hit,
                 " (approximate)" if injected.approximate else " (convertible)" if injected.convertible else "",
                 reused, "-" if plan.similarity is None else f"{plan.similarity:.3f}", ttft_ms)
        return result

    def close(self) -> None:
        """Stop the store jobs, empty the RAM tier, free the engine if this object loaded it (not
        an adapter passed in), save and close the semantic index, close the store if it opened it.
        Called from another thread while a stream holds the engine, it waits for the stream.

        Raises:
            RuntimeError: a stream of the calling thread still holds the engine (closing it
                under the stream would free the context the stream decodes in).
        """
        if self._driving == threading.get_ident():
            raise RuntimeError("EdgeSync: a stream of this thread still holds the engine: read it to the end or "
                               "close it before closing the engine")
        self.idle.close()
        if self.jobs is not None:
            self.jobs.shutdown()
            self.jobs = None
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.fragment_cache is not None:
            self.fragment_cache.clear()
        if self.semantic is not None:
            self.semantic.close()
        if self._owns_adapter:
            self.adapter.close()
        if self._owns_store and self.store is not None:
            self.store.close()

    def __enter__(self) -> "EdgeSync":
        """Raises RuntimeError when the engine is closed."""
        self._check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

