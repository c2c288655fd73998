"""The ``EdgeSync`` facade: the object applications use.

In the default mode only token-identical KV is injected, so the output equals an uncached
run's. Documents, idle-time work, the semantic lookup and prefetch are imported when first used.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from edgesync_engines.adapters.compat import compatible_with
from edgesync_engines.adapters.protocol import ContextOverflowError
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request import storeback
from edgesync_engines.request.checks import check_chat_messages, check_sampling, check_text, shown
from edgesync_engines.request.execute import Injection, Injector
from edgesync_engines.request.lanes import Lane, Lanes
from edgesync_engines.request.loading import (
    adapter_for,
    begin_page_check,
    ram_tiers,
    semantic_for,
    start_jobs,
    store_for,
    warm_up,
)
from edgesync_engines.request.result import GenerationResult, GenerationStream
from edgesync_engines.request.reuse import exact_context, strategy_for
from edgesync_engines.request.stops import decode
from edgesync_store.core.backend import FragmentBackend, MaintenanceBackend

if TYPE_CHECKING:
    from edgesync_engines.request.documents import DocumentLibrary, DocumentPrompt
    from edgesync_engines.request.idle import IdleRunner, PrepareResult
    from edgesync_store.documents.records import DocumentRecord

log = logging.getLogger(__name__)


class EdgeSync:
    """A llama.cpp or ONNX Runtime model with a persistent KV fragment cache in front of its
    prefill.

    Args:
        model: a GGUF path (with ``engine == "onnx"``: its ONNX export), a ``llama_cpp.Llama``,
            None for the configured model, or an ``EngineAdapter`` (``close`` leaves it open).
        store: a :class:`FragmentBackend`, a store directory, None for the configured store, or
            False for no cache (``request/loading.store_for``). A backend that is not a
            ``MaintenanceBackend`` has no store jobs, semantic lookup or documents.
        config: settings (default: :meth:`EdgeSyncConfig.load`).

    Thread safety: one request at a time drives each of the engine's sequences (its :class:`Lane`:
    one, or ``config.slots``, whose steps the engine batches); a request waits for a free one, and
    holds it until its stream is read to the end or closed. A call from the stream's own thread that
    would drive the engine raises RuntimeError. Idle-time work runs one batch at a time: with one
    sequence while no request runs, with several on a free one.

    Raises TypeError (``model`` or ``store`` of no type above), onnx_export.ExportError
    (``engine == "onnx"`` and the GGUF has no sound export).
    """

    def __init__(self, model=None, store: "FragmentBackend | str | os.PathLike | None | bool" = None,
                 config: EdgeSyncConfig | None = None) -> None:
        self.config = config or EdgeSyncConfig.load()
        begin_page_check(store, self.config)  # runs in a child while the model loads
        self.adapter, self._owns_adapter = adapter_for(model, self.config)
        self.store, self._owns_store, self.uncached_reason = store_for(store, self.adapter, self.config)
        self.semantic = semantic_for(self.store, self.config)
        self.fragment_cache, self.prefetcher = (None, None) if self.store is None else ram_tiers(
            self.store, self.adapter, self.config)
        self.injector = None if self.store is None else Injector(self.store, self.adapter, self.fragment_cache)
        self.lanes = Lanes([Lane(i, a, self.injector if a is self.adapter or self.store is None else
                                 Injector(self.store, a, self.fragment_cache))
                            for i, a in enumerate(self.adapter.slot_adapters())])
        warm_up(self.adapter, self.store)  # the first request's one-time work and a rehearsal, at load
        self.strategy = strategy_for(self.config.reuse, self)
        self._idle: IdleRunner | None = None
        self._library: DocumentLibrary | None = None
        self._made = threading.Lock()  # guards the two above, made at first use
        self.jobs = None if self.store is None or self.store.readonly else start_jobs(
            self.store, self._semantic_index, self.config)

    def _semantic_index(self):
        """The semantic lookup's open index once loaded (for the store jobs), else None."""
        return self.semantic.index_if_ready() if self.semantic is not None else None

    namespace = property(lambda self: self.adapter.namespace, doc="The engine's KV namespace.")

    @property
    def idle(self) -> "IdleRunner":
        """The engine's idle-time work (``request/idle.py``), made at first use."""
        with self._made:
            if self._idle is None:
                from edgesync_engines.request.idle import IdleRunner

                self._idle = IdleRunner(self)
            return self._idle

    @property
    def documents(self) -> "DocumentLibrary":
        """This engine's documents (``request/documents.py``), made at first use. Raises
        ValueError when the store is not a ``MaintenanceBackend`` (documents need its records)."""
        if self.store is not None and not isinstance(self.store, MaintenanceBackend):
            raise ValueError("documents: the store is not a MaintenanceBackend (such as FragmentStore); "
                             "documents need its records")
        with self._made:
            if self._library is None:
                from edgesync_engines.request.documents import DocumentLibrary, document_encoder

                self._library = DocumentLibrary(
                    self.store, self.adapter, document_encoder(self.semantic, self.config.embedding_backend),
                    self.config.chunk_tokens, self.config.document_header, self.fragment_cache)
            return self._library

    def forget(self, prompt: "str | Sequence[dict]", documents: "Sequence[str | dict] | None" = None) -> int:
        """Remove every fragment this prompt (with ``documents``: the documents prompt, and those
        documents) wrote or would hit, in any engine's namespace for this model, and empty the
        RAM tier: the same request is then a miss. Returns the fragments removed.

        Raises ValueError (empty prompt, malformed messages), PermissionError or StoreError."""
        self._check_open()
        tokens = self.prompt_tokens(prompt) if documents is None else list(
            self.document_prompt(prompt, documents)[0].tokens)
        if self.store is None:
            return 0
        if documents is not None:
            self.documents.forget(documents)
        namespaces = {self.namespace}
        namespaces |= {ns for ns in self.store.namespaces() if compatible_with(ns, self.namespace).usable}
        removed = sum(self.store.forget_tokens(ns, tokens) for ns in namespaces)
        if self.fragment_cache is not None:
            self.fragment_cache.clear()  # decoded KV of this prompt may sit there
        log.info("forgot %d fragments of a %d-token prompt", removed, len(tokens))
        return removed

    def add_documents(self, documents: Iterable["str | Mapping"],
                      progress: Callable[[int], None] | None = None) -> "list[DocumentRecord]":
        """Store documents (``DocumentLibrary.add_all``: their KV, records and embeddings);
        returns the records, in order.

        Raises ValueError (a bad document: nothing stored for it or after it; no store),
        PermissionError, StoreError, RuntimeError (engine closed or held by this thread's stream).
        """
        self._check_not_streaming()
        if self.store is None or self.adapter.namespace is None:
            raise ValueError("add_documents: needs a store and an engine whose KV can be cached "
                             f"({self.uncached_reason or 'store=False or EDGESYNC_CACHE=0'})")
        library = self.documents
        with self._idle_paused(), self.lanes.taken(lane=self.lanes[0]) as lane:
            lane.set_live(0)  # documents are computed in the first sequence
            return library.add_all(documents, progress)

    def list_documents(self) -> "list[DocumentRecord]":
        """The stored documents of this engine's namespace. Raises RuntimeError when closed."""
        self._check_open()
        return self.documents.list()

    def remove_documents(self, ids: Iterable["str | DocumentRecord"]) -> int:
        """Remove documents with their fragments (``DocumentLibrary.remove_ids``, whose
        KeyError and StoreError it raises); returns how many."""
        self._check_open()
        return self.documents.remove_ids(ids)

    def document_prompt(self, messages, documents=None,
                        retrieve: int | None = None) -> "tuple[DocumentPrompt, list[float] | None]":
        """The prompt of ``messages`` with ``documents`` or the ``retrieve`` nearest stored ones,
        and the retrieval scores (``DocumentLibrary.prompt``, whose errors it raises)."""
        self._check_open()
        return self.documents.prompt(messages, documents, retrieve)

    def prefetch_stats(self) -> dict | None:
        """Prefetch counters (``Prefetcher.stats``), or None when prefetch is off."""
        return None if self.prefetcher is None else self.prefetcher.stats()

    def prompt_tokens(self, prompt: "str | Sequence[dict]", add_generation_prompt: bool = True) -> list[int]:
        """Token IDs of a raw prompt string, or of chat messages rendered with the chat template
        (ending with the assistant prompt unless ``add_generation_prompt`` is False).

        Raises ValueError for a blank or malformed prompt, RuntimeError when the engine is closed.
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
        """Token IDs the next prompt of a conversation ending with ``messages`` begins with
        (``request/idle.history_tokens``). Raises as :meth:`prompt_tokens`."""
        from edgesync_engines.request.idle import history_tokens

        return history_tokens(self, messages)

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
        """Answer a prompt (a string used as is, or chat messages), reusing stored KV; returns a
        :class:`GenerationResult`, or with ``stream=True`` a :class:`GenerationStream`.

        ``documents`` or ``retrieve=k`` (the k stored documents nearest to the last user turn) go
        before the question; ``reuse`` overrides ``config.reuse``. Decoding ends at a ``stop``
        string (not in the text), an end-of-generation token, ``max_tokens``, or the stream's
        caller; the prompt is stored.

        Raises, before any engine work: ContextOverflowError (prompt + max_tokens exceed the
        context), ValueError (naming the argument), RuntimeError (engine closed or held by this
        thread's stream).
        """
        self._check_not_streaming()
        if not isinstance(stream, bool):
            raise ValueError(f"stream: must be True or False, got {shown(stream)}")
        strategy = self.strategy if reuse is None or reuse == self.strategy.mode else strategy_for(reuse, self)
        cfg, given = self.config, (max_tokens, temperature, top_p, seed)
        defaults = (cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed)
        *sampling, stops = check_sampling(*(d if g is None else g for g, d in zip(given, defaults)), stop)
        tokens = None
        if documents is not None or retrieve is not None:
            strategy, tokens = self._with_documents(strategy, prompt, documents, retrieve)
        stream_obj = GenerationStream.start(self._run(prompt, tokens, strategy, tuple(sampling), stops))
        if stream:
            return stream_obj
        for _ in stream_obj:
            pass
        return stream_obj.result

    def _with_documents(self, strategy, prompt, documents, retrieve):
        """The documents request around ``strategy`` and its prompt's tokens."""
        from edgesync_engines.request.documents import DocumentRequest

        doc_prompt, scores = self.document_prompt(prompt, documents, retrieve)
        return DocumentRequest(self.documents, strategy, doc_prompt, scores), list(doc_prompt.tokens)

    def _run(self, prompt, tokens, strategy, sampling: tuple[int, float, float, int], stop: Sequence[str]):
        """The request as a generator: "", then the text pieces, then the :class:`GenerationResult`."""
        t0 = time.perf_counter()
        max_tokens = sampling[0]
        tokens = self._checked_tokens(prompt, max_tokens, tokens)
        yield ""  # input checked: errors above raise from generate() itself
        idle = self._idle
        t_wait, progress = time.perf_counter(), 0 if idle is None else idle.progress()
        first = self.lanes[0] if strategy.first_lane else None
        self._check_open()  # a stream begun before close() and read after it
        # one lane: idle-time work stops for the request; several: only work on the lane it takes
        pause = self._idle_paused() if len(self.lanes) == 1 else nullcontext(False)
        with pause as idle_busy, self.lanes.taken(tokens, first) as lane:
            self._check_open()  # closed while this request waited for a lane
            idle_wait_ms = (time.perf_counter() - t_wait) * 1000 if idle_busy else None
            idle_wait_tokens = idle.progress() - progress if idle_busy else 0
            live_exact = lane.take_live()
            if self._idle is not None:
                self._idle.count_wasted(tokens)
            # with idle-time storing, a request that extends the live sequence continues it
            plan, injected = strategy.reuse(lane, prompt, tokens, max_tokens,
                                            live_exact if self.config.idle_store else 0)
            out: list[int] = []
            text, ttft_ms, finish = yield from decode(lane.adapter, injected.tokens, injected.reused, sampling, stop,
                                                      out, t0, lambda: self._record_hits(injected))
            written = strategy.after_answer(lane, prompt, tokens, out, plan, injected)
            exact = strategy.exact_context(injected)
            lane.set_live(len(tokens) - 1 if exact else 0)
        result = GenerationResult.of(tokens, out, text, plan, injected, written, ttft_ms,
                                     (time.perf_counter() - t0) * 1000, self.uncached_reason)
        result.finish_reason, result.idle_wait_ms, result.idle_wait_tokens = finish, idle_wait_ms, idle_wait_tokens
        result.slot = lane.index
        strategy.annotate(result)
        if exact and self.config.idle_store and not isinstance(prompt, str) and finish != "cancelled":
            self.prepare_later(list(prompt) + [{"role": "assistant", "content": result.text}])
        yield result

    def prepare(self, prompt: "str | Sequence[dict]") -> "PrepareResult":
        """Store a prompt's KV without answering it (``IdleRunner.prepare``, whose errors it
        raises; RuntimeError: the engine is closed, or a stream of this thread holds it)."""
        self._check_not_streaming()
        return self.idle.prepare(prompt)

    def prepare_later(self, history: "Sequence[dict]") -> None:
        """Queue :meth:`prepare` of chat messages as idle-time work; nothing without a writable
        store or a cacheable engine. Raises ValueError (not chat messages) or RuntimeError
        (the engine is closed)."""
        self._check_open()
        check_chat_messages(history)
        if self.store is not None and not self.store.readonly and self.adapter.namespace is not None:
            self.idle.prepare_later(history)

    def make_room(self, n_tokens: int, should_stop: Callable[[], bool] | None = None) -> bool:
        """Make room now to inject a stored prompt of ``n_tokens`` tokens later
        (``EngineAdapter.make_room``; nothing without a store); True when the room is there.
        RuntimeError: the engine is closed, or a stream of this thread holds it."""
        self._check_not_streaming()
        if self.store is None:
            return True
        with self.adapter.lock:
            return self.adapter.make_room(n_tokens, should_stop)

    def _record_hits(self, injected: Injection) -> None:
        """Count a hit on each injected fragment and, for the prompt's own exact KV, leave the
        reuse hint (namespace digest, tokens injected) that the next process rehearses."""
        if injected.keys:
            hint = (self.namespace.digest(), injected.tokens[:injected.reused]) if exact_context(injected) else None
            storeback.record_hits(self.store, injected.keys, hint)

    def _checked_tokens(self, prompt, max_tokens: int, tokens: list[int] | None = None) -> list[int]:
        """The prompt's tokens (``tokens`` when already built), checked against the context."""
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
        """Refuse a call from a thread whose stream holds a lane."""
        self._check_open()
        if self.lanes.driven_by(threading.get_ident()):
            raise RuntimeError("EdgeSync: a stream of this thread still holds the engine: read it to the "
                               "end or close it before the next call")

    def _idle_paused(self):
        """Idle-time work paused (``IdleRunner.paused``: yields whether it was busy), if any."""
        idle = self._idle
        return nullcontext(False) if idle is None else idle.paused()

    def close(self) -> None:
        """Stop idle-time work and the store jobs, empty the RAM tier, close the semantic index,
        and the engine and the store if opened here; waits for another thread's stream.
        RuntimeError: a stream of the calling thread still holds the engine."""
        if self.lanes.driven_by(threading.get_ident()):
            raise RuntimeError("EdgeSync: a stream of this thread still holds the engine: read it to the end or "
                               "close it before closing the engine")
        if self._idle is not None:
            self._idle.close()
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
