"""The router: the object applications use.

``EdgeSync(model, store, config).generate(prompt_or_messages)`` tokenizes the prompt (chat
messages through the GGUF's own template), walks the store for the longest stored prefix
whose token IDs equal the prompt's, injects it, prefills the rest, generates, and then stores
the fragments the prompt did not have, so that an exact repeat later injects all but at most
the last prompt token (the engine needs one evaluated token for the next-token logits).

Tiers are defined by what was injected: ``exact`` = all but at most one prompt token,
``partial`` = at least 64 tokens, ``miss`` = nothing. Prompts under 64 tokens are never cached
(the seed's minimum fragment span). Nothing that is not token-identical is ever injected, so
the output equals an uncached run's.

Semantic lookup (``edgesync_engines.request.semantic_lookup``): when the walk leaves at least
``semantic_min_uncovered`` (64) prompt tokens uncovered, the request is embedded and the HNSW
index nominates stored prompts ("donors") at cosine >= ``similarity_partial`` (0.75); each is
checked token by token and a longer verified prefix, if any, is injected instead. An exact hit
never runs the encoder. Every prompt that stored fragments is indexed after its answer.

The approximate mode (``reuse="semantic"``, off by default) is the seed's literal exact tier: any
request that is not an exact hit (2 or more tokens uncovered) looks, and a donor at cosine >=
``similarity_exact`` (0.92) is served whole, its KV injected although its
tokens differ from the prompt's, so the model answers the donor's prompt without prefilling
this one (``approximate: true`` in the result; nothing is stored for such a request, since the
context holds the donor's KV). Its fidelity is measured by ``edgesync fidelity``.

Prefetch (``prefetch=True``, off by default; ``edgesync_engines.request.prefetch.Prefetcher``): after
each answer the request's first-chunk key is observed, the next keys are predicted and their
fragments are decoded in a background thread into a bounded RAM tier; injection takes a
fragment from that tier while the store still holds it live, else from the store.

Engines (``engine``): llama.cpp, or ONNX Runtime on an export of the same GGUF. Each writes and
reads its own namespace. With ``allow_convertible`` (off by default) a request that its own
namespace does not serve whole also walks the namespaces that ``compat.compatible_with`` calls
convertible (the other engine, same model), and a longer chain found there is converted
(``reshape.convert_fragment``) and injected: ``convertible: true`` in the result, whose output is
close to, not always equal to, an uncached run's. Such a request stores nothing, since its
context holds converted KV. Namespaces of another model or head layout are never walked.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import lmdb

from edgesync_store.lifecycle.merge import group_ranges, split_heads, split_layers
from edgesync_store.schema import MIN_SPAN, chunk_spans, common_prefix_len, prefix_hash, store_key
from edgesync_store.lifecycle.jobs import StoreJobs
from edgesync_store.core.store import FragmentStore, PrefixMatch, StoreOpenError, StoreUnavailableError
from edgesync_store.ttl import TTLPolicy

from edgesync_engines.adapters.protocol import ContextOverflowError, InjectionError
from edgesync_engines.adapters.compat import CONVERTIBLE, compatible_with
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.adapters.onnxrt import OnnxRuntimeAdapter
from edgesync_engines.request.prefetch import Prefetcher, request_key
from edgesync_engines.adapters.reshape import convert_fragment
from edgesync_engines.request.semantic_lookup import SemanticLookup

log = logging.getLogger("edgesync.router")

TIER_EXACT, TIER_PARTIAL, TIER_MISS = "exact", "partial", "miss"


@dataclass
class GenerationResult:
    """What one request produced and what it cost.

    Token counts are tokens; times are milliseconds; sizes are bytes. ``similarity`` is the
    cosine of the best donor the semantic lookup found (None when the lookup did not run or
    found none); ``lookup_ms`` the lookup's cost (encode + search + donor checks, None when it
    did not run); ``donor`` the hex key (the last fragment of its chain) of the nominated donor
    whose verified prefix was injected, or that reached as far as the prefix walk did, or that
    was served whole (None when no nominated donor matched that far). ``tokens_prefilled`` is what this request evaluated
    (``prompt_tokens - tokens_reused``, except in the approximate mode, where the donor's
    remaining tokens are evaluated instead). ``approximate`` is True when the answer came from
    a donor's KV whose tokens differ from the prompt's (``reuse="semantic"`` only).
    ``ram_tier_hits`` counts the fragments injected from the prefetch RAM tier instead of
    being read and decoded from the store (0 when prefetch is off). ``convertible`` is True
    when the injected KV was written by another engine and converted (``allow_convertible``
    only); ``source_engine`` names the engine whose KV was injected (None on a miss).
    """

    text: str
    tokens: list[int]
    tier: str
    similarity: float | None
    prompt_tokens: int
    tokens_reused: int
    tokens_prefilled: int
    ttft_ms: float
    total_ms: float
    bytes_read: int
    fragments_written: int = 0
    approximate: bool = False
    lookup_ms: float | None = None
    donor: str | None = None
    ram_tier_hits: int = 0
    convertible: bool = False
    source_engine: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Plan:
    """What a request injects: the token sequence to continue (the prompt's, or a donor's in
    the approximate mode), how many of its tokens are injected, and the lookup's findings."""

    tokens: list[int]
    reused: int = 0
    keys: list = field(default_factory=list)
    bytes_read: int = 0
    similarity: float | None = None
    embedded: object = None
    lookup_ms: float | None = None
    donor: str | None = None
    approximate: bool = False
    convertible: bool = False
    source_engine: str | None = None


class GenerationStream:
    """Iterator over the text pieces of a streamed generation; ``result`` is set at the end.

    The engine is locked from the first piece until the stream is exhausted or closed: a
    caller that stops early calls :meth:`close` (or uses ``with``), else other threads wait
    until the stream is garbage-collected. Consume a stream in the thread that created it.
    """

    def __init__(self, events: Iterator[str]) -> None:
        self._source = events
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> str:
        return next(self._events)

    def close(self) -> None:
        """Stop generating and release the engine (idempotent)."""
        for gen in (self._events, self._source):
            close = getattr(gen, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_ADAPTERS = (LlamaCppAdapter, OnnxRuntimeAdapter)


class EdgeSync:
    """A llama.cpp or ONNX Runtime model with a persistent KV fragment cache in front of its
    prefill.

    Args:
        model: a GGUF path, a ``llama_cpp.Llama``, a :class:`LlamaCppAdapter` or
            :class:`OnnxRuntimeAdapter`, or None for the configured model
            (SmolLM2-135M-Instruct by default). With ``config.engine == "onnx"`` a GGUF path
            means its ONNX export (``edgesync export-onnx``).
        store: a :class:`FragmentStore`, a store directory, None for the configured store, or
            False for no cache at all (every request prefills from scratch).
        config: settings (default: :meth:`EdgeSyncConfig.load`, i.e. defaults < environment).

    Thread safety: one request at a time drives the engine (the adapter's lock).

    Raises:
        onnx_export.ExportError: ``config.engine == "onnx"`` and the GGUF has no sound ONNX
            export.
    """

    def __init__(self, model=None, store: "FragmentStore | str | os.PathLike | None | bool" = None,
                 config: EdgeSyncConfig | None = None) -> None:
        self.config = config or EdgeSyncConfig.load()
        self._owns_adapter = not isinstance(model, _ADAPTERS)
        if isinstance(model, _ADAPTERS):
            self.adapter = model
        elif self.config.engine == "onnx":
            if model is not None and not isinstance(model, (str, os.PathLike)):
                raise TypeError(f"model: the onnx engine takes a GGUF path or an OnnxRuntimeAdapter, "
                                f"got {type(model).__name__}")
            self.adapter = OnnxRuntimeAdapter(
                model if model is not None else self.config.model_path,
                n_ctx=self.config.n_ctx,
                n_threads=self.config.n_threads,
                seed=self.config.seed,
            )
        else:
            self.adapter = LlamaCppAdapter(
                model if model is not None else self.config.model_path,
                n_ctx=self.config.n_ctx,
                n_threads=self.config.n_threads,
                flash_attn=self.config.flash_attn,
                verbose=self.config.verbose_engine,
                seed=self.config.seed,
            )
        self._owns_store = False
        if store is False or not self.config.cache_enabled:
            self.store = None
        elif isinstance(store, FragmentStore):
            self.store = store
        elif store is not None and not isinstance(store, (str, os.PathLike)):
            raise TypeError(f"store: expected a FragmentStore, a path, None or False, got {type(store).__name__}")
        else:
            self.store = self._open_store(Path(store if store is not None else self.config.store_path))
            self._owns_store = self.store is not None
        self.semantic = None
        if self.store is not None and self.config.semantic:
            self.semantic = SemanticLookup(self.store, self.config)
            self.semantic.warm_up()  # loads the embedder and index in the background
        self.prefetcher = None
        if self.store is not None and self.config.prefetch:
            self.prefetcher = Prefetcher(self.store, self.namespace, self.config.prefetch_ram_bytes)
        self._ram_hits = 0  # of the current request (requests hold the adapter's lock)
        self.jobs = None
        if self.store is not None and not self.store.readonly and self.config.jobs:
            self.jobs = StoreJobs(self.store, self._semantic_index, self.config.sweep_interval_s,
                                  self.config.compact_interval_s).start()

    def _open_store(self, path: Path) -> FragmentStore | None:
        """Open the configured store with this config's TTL and budget. A store the system
        will not let us write (a read-only disk or directory, no space or permission to
        create it) is opened read-only, or not at all, with a warning: requests are then served
        from what it holds, or uncached, never failed. A path that is not a store (a file, a
        foreign directory) still raises ``StoreOpenError``."""
        policy = TTLPolicy(ttl_seconds=self.config.ttl_seconds)
        try:
            return FragmentStore(path, policy=policy, max_bytes=self.config.max_bytes)
        except StoreUnavailableError as exc:
            if not (path / "data.mdb").exists():
                log.warning("fragment store unavailable, serving uncached: %s", exc)
                return None
            log.warning("fragment store %s cannot be written (%s); serving from it read-only", path, exc)
        try:
            return FragmentStore(path, readonly=True, policy=policy)
        except (StoreOpenError, lmdb.Error, OSError) as exc:
            log.warning("fragment store unavailable, serving uncached: %s", exc)
            return None

    def _semantic_index(self):
        """The semantic lookup's open index once loaded (for the store jobs), else None."""
        return self.semantic.index_if_ready() if self.semantic is not None else None

    def forget(self, prompt: "str | Sequence[dict]") -> int:
        """Remove every fragment this prompt wrote or would hit: at each position of its
        tokens, the stored fragments (any chunk size, layer or head group, live or expired)
        that follow its prefix and start with its next token, written by this engine or by
        another engine for the same model, with their donor records and vectors; the prefetch
        RAM tier drops nothing it could still serve (it serves only what the store holds).
        Afterwards the same prompt is a miss. Returns the fragments removed.

        Raises:
            ValueError: an empty prompt or malformed chat messages.
            PermissionError: the store is open read-only.
            lmdb.Error: the store could not be written.
        """
        tokens = self.prompt_tokens(prompt)
        if self.store is None:
            return 0
        # every engine's copy: KV another engine wrote for this model would still serve it
        # with allow_convertible
        namespaces = {self.namespace}
        namespaces |= {ns for ns in self.store.namespaces() if compatible_with(ns, self.namespace).usable}
        removed = sum(self.store.forget_tokens(ns, tokens) for ns in namespaces)
        if self.prefetcher is not None:
            self.prefetcher.ram.clear()  # decoded KV of this prompt may sit there
        log.info("forgot %d fragments of a %d-token prompt", removed, len(tokens))
        return removed

    @property
    def namespace(self):
        """The engine's KV namespace."""
        return self.adapter.namespace

    def prefetch_stats(self) -> dict | None:
        """Prefetch counters (:meth:`Prefetcher.stats`: predictor ``top1``/``topk`` accuracy
        over ``predictions``, RAM tier ``hits``, ``misses``, ``bytes``, ``entries``...), or None
        when prefetch is off."""
        return None if self.prefetcher is None else self.prefetcher.stats()

    def prompt_tokens(self, prompt: "str | Sequence[dict]") -> list[int]:
        """Token IDs of a raw prompt string, or of chat messages rendered with the chat template.

        Raises:
            ValueError: a blank prompt, no messages, or messages whose contents are all blank.
        """
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt: is empty")
            text = prompt
        else:
            if not prompt:
                raise ValueError("prompt: no chat messages")
            for i, m in enumerate(prompt):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError(f"prompt: messages[{i}] must be a dict with string 'role' and 'content'")
            if all(not str(m.get("content", "")).strip() for m in prompt if isinstance(m, dict)):
                raise ValueError("prompt: every chat message is empty")
            text = self.adapter.apply_chat_template(prompt)
        return self.adapter.tokenize(text)

    def generate(
        self,
        prompt: "str | Sequence[dict]",
        max_tokens: int | None = None,
        stream: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> "GenerationResult | GenerationStream":
        """Answer a prompt (a string used as is, or chat messages), reusing stored KV.

        Returns a :class:`GenerationResult`, or with ``stream=True`` a
        :class:`GenerationStream` of text pieces whose ``result`` is set once exhausted.

        Raises:
            ContextOverflowError: prompt tokens + max_tokens exceed the context (no engine
                work is done).
            ValueError: an empty prompt or malformed chat messages.
        """
        cfg = self.config
        events = self._run(
            prompt,
            cfg.max_tokens if max_tokens is None else max_tokens,
            cfg.temperature if temperature is None else temperature,
            cfg.top_p if top_p is None else top_p,
            cfg.seed if seed is None else seed,
        )
        stream_obj = GenerationStream(events)
        # Run up to the first yield now so that input errors raise here, not at iteration.
        first = next(events, None)
        if first is None or isinstance(first, GenerationResult):
            stream_obj.result = first

            def empty() -> Iterator[str]:
                return iter(())

            stream_obj._events = empty()
        else:
            def chained() -> Iterator[str]:
                piece = first
                while True:
                    if isinstance(piece, GenerationResult):
                        stream_obj.result = piece
                        return
                    if piece:
                        yield piece
                    piece = next(events)

            stream_obj._events = chained()
        if stream:
            return stream_obj
        for _ in stream_obj:
            pass
        return stream_obj.result

    def _run(self, prompt, max_tokens: int, temperature: float, top_p: float, seed: int):
        t0 = time.perf_counter()
        if self.adapter.closed:
            raise RuntimeError("EdgeSync: the engine is closed")
        tokens = self.prompt_tokens(prompt)
        if not tokens:
            raise ValueError("prompt: tokenizes to nothing")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        if not (temperature >= 0 and temperature < float("inf")):
            raise ValueError(f"temperature: must be a finite number >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")

        if len(tokens) + max_tokens > self.adapter.n_ctx:
            raise ContextOverflowError(len(tokens), max_tokens, self.adapter.n_ctx)
        yield ""  # input checked: errors above raise from generate() itself
        with self.adapter.lock:
            self._ram_hits = 0
            plan = self._reuse(prompt, tokens, max_tokens)
            reused, used_keys = plan.reused, plan.keys
            n = len(tokens)
            if plan.approximate:
                tier = TIER_EXACT
            else:
                tier = TIER_EXACT if reused and reused >= n - 1 else TIER_PARTIAL if reused >= MIN_SPAN else TIER_MISS
            out: list[int] = []
            decoder = self.adapter.text_stream()
            ttft_ms = None
            for token in self.adapter.generate(plan.tokens, reused, max_tokens, temperature, top_p, seed):
                if ttft_ms is None:
                    ttft_ms = (time.perf_counter() - t0) * 1000
                out.append(token)
                yield decoder.decode(self.adapter.token_bytes(token))
                if len(out) == 1 and used_keys:
                    self._record_hits(used_keys)
            # bytes of a character cut by max_tokens stay out of the text (no trailing U+FFFD)
            if ttft_ms is None:
                ttft_ms = (time.perf_counter() - t0) * 1000
                if used_keys:
                    self._record_hits(used_keys)
            # the context holds a donor's or another engine's KV: nothing to store
            foreign = plan.approximate or plan.convertible
            written = 0 if foreign else self._store_new(tokens)
            if not foreign:
                self._index_prompt(prompt, tokens, plan.embedded)
            if self.prefetcher is not None:
                key = request_key(self.namespace, tokens, self.config.chunk_tokens)
                self.prefetcher.after_request(key, tokens + out)
            ram_hits = self._ram_hits
        total_ms = (time.perf_counter() - t0) * 1000
        result = GenerationResult(
            text=self.adapter.text_stream().decode(b"".join(self.adapter.token_bytes(t) for t in out)),
            tokens=out,
            tier=tier,
            similarity=plan.similarity,
            prompt_tokens=n,
            tokens_reused=reused,
            tokens_prefilled=len(plan.tokens) - reused,
            ttft_ms=ttft_ms,
            total_ms=total_ms,
            bytes_read=plan.bytes_read,
            fragments_written=written,
            approximate=plan.approximate,
            lookup_ms=plan.lookup_ms,
            donor=plan.donor,
            ram_tier_hits=ram_hits,
            convertible=plan.convertible,
            source_engine=plan.source_engine if reused else None,
        )
        log.info("request: %d prompt tokens, tier %s%s, reused %d, similarity %s, ttft %.1f ms", n, tier,
                 " (approximate)" if plan.approximate else " (convertible)" if plan.convertible else "", reused,
                 "-" if plan.similarity is None else f"{plan.similarity:.3f}", ttft_ms)
        yield result

    def _walk(self, tokens, namespace=None) -> PrefixMatch:
        """The store's longest token-identical prefix of ``tokens`` in ``namespace`` (default:
        the engine's own; empty on a read error)."""
        try:
            return self.store.prefix_walk(namespace or self.namespace, tokens)
        except lmdb.Error as exc:
            log.warning("store unreadable, prefilling: %s", exc)
            return PrefixMatch()

    def _reuse(self, prompt, tokens: list[int], max_tokens: int) -> "_Plan":
        """Decide what to inject, and inject it.

        The prefix walk first; when it leaves ``semantic_min_uncovered`` or more tokens
        uncovered, the semantic lookup nominates donors: in the approximate mode the best one
        at ``similarity_exact`` or above is served whole, otherwise every candidate is checked
        token by token and the longest verified prefix wins. Never raises for a store or
        engine problem: the request then prefills more.
        """
        n = len(tokens)
        plan = _Plan(tokens=tokens)
        if self.store is None or n < MIN_SPAN:
            return plan
        match = self._walk(tokens)
        limit, donor_key = match.matched_tokens, None
        cfg = self.config
        # Default mode: a donor can only add verified tokens, worth an encode (~15 ms) when 64 or
        # more are uncovered. Approximate mode: a donor saves every uncovered token, so any
        # request that is not an exact hit looks (a short question behind a shared system
        # prompt is the common case there).
        gate = cfg.semantic_min_uncovered if cfg.reuse == "exact" else 2
        if self.semantic is not None and n - match.matched_tokens >= gate:
            t_lookup = time.perf_counter()
            lookup = self.semantic.nominate(prompt, self.namespace)
            if lookup is not None:
                plan.similarity, plan.embedded = lookup.similarity, lookup.embedded
                if cfg.reuse == "semantic":
                    # Only a donor that shares everything before the embedded text (system
                    # prompt, earlier turns) may stand in for this prompt: the embedding sees the
                    # last user turn alone, so the same question in another app or conversation
                    # scores 1.0.
                    context = self._context_len(prompt, tokens, lookup.embedded[0])
                    for donor in lookup.donors:
                        if donor.similarity < cfg.similarity_exact:
                            break
                        if common_prefix_len(tokens, donor.tokens) < context:
                            continue
                        if self._serve_donor(donor, max_tokens, plan):
                            plan.lookup_ms = (time.perf_counter() - t_lookup) * 1000
                            return plan
                # Token by token: a donor's stored chain counts up to where its tokens stop
                # matching the prompt's. A longer verified prefix than the walk's replaces it;
                # one as long confirms it (reported as the donor).
                for donor in lookup.donors:
                    common = common_prefix_len(tokens, donor.tokens)
                    if common < max(limit, MIN_SPAN):
                        continue
                    donor_match = self._walk(donor.tokens)
                    verified = min(donor_match.matched_tokens, common)
                    if verified > limit:
                        match, limit, donor_key = donor_match, verified, donor.key
                    elif verified == limit and donor_key is None:
                        donor_key = donor.key
                plan.lookup_ms = (time.perf_counter() - t_lookup) * 1000
        own = self.adapter.usable_prefix(min(match.matched_tokens, limit), n)
        whole = self.adapter.usable_prefix(n - 1, n)
        if cfg.allow_convertible and own < whole and self._inject_convertible(tokens, plan, own):
            return plan
        plan.reused, plan.keys, plan.bytes_read = self._inject(match, limit, tokens)
        plan.source_engine = self.namespace.engine
        if plan.reused and donor_key is not None:
            plan.donor = donor_key.hex()
        return plan

    def _convertible_namespaces(self) -> list:
        """The store's namespaces whose KV ``compatible_with`` calls convertible for this
        engine (same model and geometry, another engine or settings); the others are skipped
        with their reason logged."""
        try:
            stored = self.store.namespaces()
        except lmdb.Error as exc:
            log.warning("store unreadable, no cross-engine lookup: %s", exc)
            return []
        usable = []
        for ns in stored:
            if ns == self.namespace:
                continue
            verdict = compatible_with(ns, self.namespace)
            if verdict.verdict == CONVERTIBLE:
                usable.append(ns)
            else:
                log.debug("stored %s KV not usable here: %s", ns.engine, verdict.reason)
        return usable

    def _inject_convertible(self, tokens: list[int], plan: "_Plan", own: int) -> bool:
        """``allow_convertible``: walk every convertible namespace and inject the longest chain
        found, converted, when it covers more than the ``own`` tokens the engine's own
        namespace would give. True when it did (``plan`` filled), else False (the engine's
        KV is then undefined: the caller injects its own or prefills)."""
        best = None
        for ns in self._convertible_namespaces():
            match = self._walk(tokens, ns)
            usable = self.adapter.usable_prefix(match.matched_tokens, len(tokens))
            if usable > (best[0] if best else own):
                best = (usable, ns, match)
        if best is None:
            return False
        _, ns, match = best
        reused, keys, nbytes = self._inject(match, match.matched_tokens, tokens, ns)
        if reused <= own:
            return False
        plan.reused, plan.keys, plan.bytes_read = reused, keys, plan.bytes_read + nbytes
        plan.convertible, plan.source_engine, plan.donor = True, ns.engine, None
        log.info("injected %d tokens of %s KV, converted for %s", reused, ns.engine, self.namespace.engine)
        return True

    def _serve_donor(self, donor, max_tokens: int, plan: "_Plan") -> bool:
        """Approximate mode: inject the donor's stored KV whole and make its tokens the
        sequence to continue. False (nothing changed) when its chain is too short or gone or
        the donor prompt does not fit the context with ``max_tokens``."""
        d_tokens = [int(t) for t in donor.tokens]
        if len(d_tokens) + max_tokens > self.adapter.n_ctx:
            return False
        walk = self._walk(d_tokens)
        whole = self.adapter.usable_prefix(len(d_tokens) - 1, len(d_tokens))
        if walk.matched_tokens < whole:  # part of its chain expired or was refused
            log.info("donor %s: %d of its %d tokens are stored; not served", donor.key.hex()[:16],
                     walk.matched_tokens, len(d_tokens))
            if walk.matched_tokens == 0:
                self.semantic.forget(donor.key)
            return False
        reused, keys, nbytes = self._inject(walk, len(d_tokens), d_tokens)
        if reused < whole:
            self.adapter.clear_kv_cache()
            return False
        plan.tokens, plan.reused, plan.keys, plan.bytes_read = d_tokens, reused, keys, nbytes
        plan.approximate, plan.donor = True, donor.key.hex()
        return True

    def _inject(self, match: PrefixMatch, limit: int, tokens: list[int], namespace=None) -> tuple[int, list[bytes], int]:
        """Fetch, verify and inject the spans of ``match`` up to ``limit`` tokens of ``tokens``;
        a ``namespace`` other than the engine's own (convertible) has its fragments converted.

        Returns (tokens injected, keys used, compressed bytes read).

        The fragments are pinned from their first read until llama.cpp holds their KV, so no
        eviction in any process takes them meanwhile. One that is gone when read (another
        process's compaction merged or evicted it between the walk and the pin) makes the
        router walk again once, pinned, and take the longer of the two. Any failure (corrupt
        fragment, engine refusal) degrades to fewer tokens or to none, never to an error: the
        request then prefills.
        """
        n = len(tokens)
        bytes_total = 0
        for attempt in (1, 2):
            target = self.adapter.usable_prefix(min(match.matched_tokens, limit), n)
            if target < MIN_SPAN:
                return 0, [], bytes_total
            pinned = [key for span in match.spans if span.token_start < target for key in span.keys]
            with self.store.pins.pinned(pinned):  # eviction in any process skips them meanwhile
                fragments, keys, nbytes, covered, missing = self._fetch_spans(match, target)
                bytes_total += nbytes
                if missing and attempt == 1:
                    again = self._walk(tokens, namespace)
                    if again.matched_tokens > covered:
                        log.info("a fragment went away after the walk (%d tokens read); walking again", covered)
                        match, limit = again, again.matched_tokens  # the prompt's own tokens: all verified
                        continue
                if missing:
                    log.warning("a stored fragment was refused or is gone; injecting %d of %d matched tokens",
                                covered, match.matched_tokens)
                target = self.adapter.usable_prefix(min(target, covered), n)
                if target < MIN_SPAN:
                    return 0, [], bytes_total
                try:
                    if namespace is not None and namespace != self.namespace:
                        fragments = [convert_fragment(f, self.namespace) for f in fragments]
                    self.adapter.inject_fragment(fragments, target, tokens)
                except (ValueError, InjectionError) as exc:
                    log.warning("injection refused, prefilling from scratch: %s", exc)
                    self.adapter.clear_kv_cache()
                    return 0, [], bytes_total
                return target, keys, bytes_total
        return 0, [], bytes_total  # pragma: no cover - the second attempt always returns

    def _fetch_spans(self, match: PrefixMatch, target: int):
        """Read the spans of ``match`` below ``target``: (fragments, keys, compressed bytes,
        tokens covered, whether a fragment was missing or refused)."""
        fragments, keys, bytes_read, covered = [], [], 0, 0
        for span in match.spans:
            if span.token_start >= target:
                break
            got = [self._fetch(key) for key in span.keys]
            if any(f is None for f in got):
                log.info("fragment at [%d, %d) was refused or is gone after the walk (%d tokens read)",
                         span.token_start, span.token_end, covered)
                return fragments, keys, bytes_read, covered, True
            fragments.extend(got)
            keys.extend(span.keys)
            bytes_read += span.compressed_nbytes
            covered = span.token_start + span.matched
        return fragments, keys, bytes_read, covered, False

    def _fetch(self, key: bytes):
        """The decoded fragment under ``key``: from the prefetch RAM tier while the store still
        holds it live, else from the store (None: absent or corrupt)."""
        if self.prefetcher is not None:
            try:
                frag = self.prefetcher.lookup(key)
            except lmdb.Error as exc:
                log.warning("RAM tier check failed, reading the store: %s", exc)
                frag = None
            if frag is not None:
                self._ram_hits += 1
                return frag
        return self.store.get(key)

    def _context_len(self, prompt, tokens: list[int], text: str) -> int:
        """Prompt tokens before the embedded text: for chat messages ending with a user turn,
        everything up to that turn's content (found by rendering the messages with that
        content emptied); otherwise all but the embedded text's own tokens and 8 more (the
        template's closing tokens and tokenizer boundary effects)."""
        if not isinstance(prompt, str) and prompt and prompt[-1].get("role") == "user":
            emptied = list(prompt[:-1]) + [{**prompt[-1], "content": ""}]
            try:
                return common_prefix_len(tokens, self.adapter.tokenize(self.adapter.apply_chat_template(emptied)))
            except (ValueError, TypeError) as exc:
                log.debug("chat template of the emptied turn failed (%s); estimating", exc)
        return max(0, len(tokens) - len(self.adapter.tokenize(text)) - 8)

    def _last_chunk_key(self, tokens: list[int]) -> bytes | None:
        """Store key of the last chunk of the prompt's own chunk grid (None: too short): the key
        of its first fragment under the configured grouping (layer group 0 x head group 0; the
        whole chunk when neither ``layers_per_fragment`` nor ``heads_per_fragment`` is set)."""
        spans = chunk_spans(len(tokens) - 1, self.config.chunk_tokens)
        if not spans:
            return None
        ns = self.namespace
        s, e = spans[-1]
        (l0, l1), (h0, h1) = group_ranges(ns, self.config.layers_per_fragment, self.config.heads_per_fragment)[0]
        return store_key(ns, prefix_hash(tokens[:s]), tokens[s:e], s, l0, l1, 1, h0, h1)

    def _index_prompt(self, prompt, tokens: list[int], embedded) -> None:
        """Index the prompt as a donor (after its answer, off the TTFT path) when its chain is
        stored and it is not indexed yet."""
        if self.semantic is None:
            return
        if embedded is None and not self.semantic.ready_now():
            return  # the embedder is still loading: do not make this request wait for it
        key = self._last_chunk_key(tokens)
        try:
            if key is None or not self.store.is_live(key) or self.semantic.contains(key):
                return
        except lmdb.Error as exc:
            log.warning("could not index the prompt: %s", exc)
            return
        self.semantic.remember(key, self.namespace, tokens, prompt, embedded)

    def _record_hits(self, keys: list[bytes]) -> None:
        try:
            self.store.record_hits(keys)
        except (lmdb.Error, OSError) as exc:
            log.warning("could not record hits: %s", exc)

    def _store_new(self, tokens: list[int]) -> int:
        """Extract and store the prompt's chunks that the store lacks (or holds expired);
        return how many fragments were written.

        Every chunk of the prompt's own grid is kept, even where fragments of another chunk
        size hold the same tokens, so that the prompt's chain from position 0 is complete and
        an exact repeat injects all of it. Chunks cover the prompt but its last token, whose KV
        came from a one-token evaluation (see ``LlamaCppAdapter.usable_prefix``).

        A chunk counts as stored when live fragments of exactly its span together hold every
        layer and KV head, whatever their grouping (``covers_span``). Missing chunks are
        extracted whole (one seq-state read for all) and cut into the configured
        ``layers_per_fragment`` x ``heads_per_fragment`` groups; all fragments of all chunks go
        in one ``put_many`` (one write transaction, so no reader sees half a chunk).
        """
        if self.store is None:
            return 0
        ns = self.namespace
        covers = self.store.covers_span
        try:
            spans = [
                (s, e)
                for s, e in chunk_spans(len(tokens) - 1, self.config.chunk_tokens)
                if not covers(ns, prefix_hash(tokens[:s]), tokens[s:e], s)
            ]
            if not spans:
                return 0
            (l0, l1), (h0, h1) = group_ranges(ns, self.config.layers_per_fragment, self.config.heads_per_fragment)[0]
            wholes = self.adapter.extract_fragments(tokens, spans, ttl_seconds=self.config.ttl_seconds,
                                                    now=self.store.clock())
            fragments = [
                part
                for whole in wholes
                for layer_part in split_layers(whole, l1 - l0)
                for part in split_heads(layer_part, h1 - h0)
            ]
            written = self.store.put_many(fragments)
        except (lmdb.Error, OSError, ValueError) as exc:
            log.warning("could not store fragments, serving uncached: %s", exc)
            return 0
        return written

    def close(self) -> None:
        """Stop the store jobs, free the engine if this object loaded it (an adapter passed in
        stays open), save and close the semantic index, and close the store if this object
        opened it."""
        if self.jobs is not None:
            self.jobs.shutdown()
            self.jobs = None
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.semantic is not None:
            self.semantic.close()
        if self._owns_adapter:
            self.adapter.close()
        if self._owns_store and self.store is not None:
            self.store.close()

    def __enter__(self) -> "EdgeSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

