"""What a request reuses, decided in one place: :func:`plan_reuse` returns a :class:`ReusePlan`.

The plan reads the store and changes neither store nor engine. Its sources are listed best
first; the executor injects the first that delivers its ``required`` tokens. In order:

1. Under ``MIN_SPAN`` (64) prompt tokens, no store, or KV that cannot be cut: no source.
2. The prefix walk of the engine's namespace: the longest stored chain whose token IDs equal
   the prompt's.
3. ``reuse="semantic"`` only, when the walk leaves at least :data:`APPROXIMATE_MIN_UNCOVERED`
   tokens: donors at cosine >= ``similarity_exact`` that share everything before the embedded
   text and are stored whole become :data:`SourceKind.DONOR` sources (served whole); others
   count up to where their tokens stop matching, and the longest verified prefix replaces the
   walk's.
4. ``allow_convertible``: a longer chain of a convertible namespace (``compat``: the other
   engine, same model) becomes a :data:`SourceKind.CONVERTIBLE` source.
5. Last, the own prefix of step 2 or 3 (:data:`SourceKind.PREFIX`), at any length.

Tokens a chain yields: the adapter's ``usable_prefix`` (never the last prompt token).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from edgesync_engines.adapters.compat import CONVERTIBLE, compatible_with
from edgesync_store.core.walk import PrefixMatch
from edgesync_store.errors import StoreError
from edgesync_store.schema import MIN_SPAN, Namespace, common_prefix_len

if TYPE_CHECKING:
    from edgesync_engines.adapters.protocol import EngineAdapter
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.semantic_lookup import Donor, Lookup, SemanticLookup
    from edgesync_store.core.backend import FragmentBackend

log = logging.getLogger(__name__)

APPROXIMATE_MIN_UNCOVERED = 2
"""Uncovered prompt tokens after the walk that start a semantic lookup: any request that is not
an exact hit looks."""


class HitKind:
    """What a request's injection amounted to (``GenerationResult.hit``)."""

    EXACT = "exact"
    """All prompt tokens but at most the last one injected, or a donor served whole."""
    PARTIAL = "partial"
    """At least ``MIN_SPAN`` (64) tokens injected, but not all."""
    MISS = "miss"
    """Nothing injected."""


class ReuseMode:
    """``EdgeSyncConfig.reuse``: what may stand in for a prompt's KV."""

    EXACT = "exact"
    """Only KV of token-identical prefixes (the default): the output equals an uncached run's."""
    SEMANTIC = "semantic"
    """Also a similar donor prompt's KV, served whole (approximate answers)."""
    BLEND = "blend"
    """Documents' stored KV placed at their positions, a share recomputed (approximate
    answers; ``request/blend.py``); other prompts as in ``EXACT``."""


class SourceKind:
    """Where a :class:`ReuseSource`'s KV comes from."""

    PREFIX = "prefix"
    """The engine's own namespace, token-identical to the prompt."""
    DONOR = "donor"
    """A donor prompt's chain, served whole in place of the prompt (approximate mode)."""
    CONVERTIBLE = "convertible"
    """Another engine's namespace for the same model, converted before injection."""


def hit_kind(reused: int, n_prompt: int, approximate: bool = False) -> str:
    """The :class:`HitKind` of a request that injected ``reused`` of its ``n_prompt`` tokens
    (``approximate``: a donor was served whole, which counts as exact)."""
    if approximate or (reused and reused >= n_prompt - 1):
        return HitKind.EXACT
    return HitKind.PARTIAL if reused >= MIN_SPAN else HitKind.MISS


@dataclass(frozen=True)
class ReuseSource:
    """One KV source the executor may inject.

    Attributes:
        tokens: the sequence to continue once injected (the prompt's, or a donor's).
        match: the prefix walk of ``tokens`` in ``namespace`` (what to fetch).
        limit: tokens of ``match`` verified equal to ``tokens``.
        namespace: where the fragments are stored (converted when not the engine's).
        required: the fewest injected tokens worth it; fewer and the executor moves on.
        donor: hex key of the donor behind this source (None: none).
    """

    kind: str
    tokens: tuple[int, ...]
    match: PrefixMatch
    limit: int
    namespace: Namespace
    required: int = 0
    donor: str | None = None


@dataclass(frozen=True)
class ReusePlan:
    """What a request reuses: the boundary between :func:`plan_reuse` and the executor.

    Attributes:
        sources: the sources to try, in order (empty: prefill everything).
        similarity: cosine of the best donor the lookup found (None: not run, or none).
        embedded: the request's (text, float32 ``[384]`` embedding) when the lookup ran.
        lookup_ms: the lookup's cost in milliseconds (None: not run).
        stale_donors: keys of nominated donors whose chain is gone (to drop from the index).
    """

    prompt: tuple[int, ...]
    sources: tuple[ReuseSource, ...] = ()
    similarity: float | None = None
    embedded: tuple | None = None
    lookup_ms: float | None = None
    stale_donors: tuple[bytes, ...] = ()


def walk(store: "FragmentBackend", namespace: Namespace, tokens: Sequence[int]) -> PrefixMatch:
    """The store's longest token-identical prefix of ``tokens`` in ``namespace`` (empty, with a
    warning, when the store cannot be read)."""
    try:
        return store.prefix_walk(namespace, tokens)
    except StoreError as exc:
        log.warning("store unreadable, prefilling: %s", exc)
        return PrefixMatch()


def plan_reuse(prompt, tokens: Sequence[int], max_tokens: int, *, store: "FragmentBackend | None",
               adapter: "EngineAdapter", config: "EdgeSyncConfig",
               semantic: "SemanticLookup | None" = None) -> ReusePlan:
    """Decide what the request ``prompt`` (a string or chat messages, tokenized as ``tokens``)
    reuses, for an answer of up to ``max_tokens`` tokens: the steps in the module docstring
    (``semantic``: the lookup, None: off). Never raises for a store problem (a failed walk
    finds nothing)."""
    tokens = tuple(int(t) for t in tokens)
    n = len(tokens)
    if store is None or adapter.cache_refusal is not None or n < MIN_SPAN:
        return ReusePlan(prompt=tokens)
    own_ns = adapter.namespace
    match = walk(store, own_ns, tokens)
    limit, donor_key = match.matched_tokens, None
    found = _Found()
    approximate = config.reuse == ReuseMode.SEMANTIC
    if semantic is not None and approximate and n - match.matched_tokens >= APPROXIMATE_MIN_UNCOVERED:
        t_lookup = time.perf_counter()
        lookup = semantic.nominate(prompt, own_ns)
        if lookup is not None:
            found.similarity, found.embedded = lookup.similarity, lookup.embedded
            _donor_sources(prompt, tokens, max_tokens, lookup, store, adapter, config, found)
            match, limit, donor_key = _verified_prefix(tokens, lookup.donors, match, limit, store, own_ns)
            found.lookup_ms = (time.perf_counter() - t_lookup) * 1000
    own = adapter.usable_prefix(min(match.matched_tokens, limit), n)
    if config.allow_convertible and own < adapter.usable_prefix(n - 1, n):
        convertible = _convertible_source(tokens, own, store, adapter)
        if convertible is not None:
            found.sources.append(convertible)
    found.sources.append(ReuseSource(SourceKind.PREFIX, tokens, match, limit, own_ns,
                                     donor=None if donor_key is None else donor_key.hex()))
    return ReusePlan(prompt=tokens, sources=tuple(found.sources), similarity=found.similarity,
                     embedded=found.embedded, lookup_ms=found.lookup_ms, stale_donors=tuple(found.stale))


class _Found:
    """What :func:`plan_reuse` collects on its way (mutable; frozen into the plan at the end)."""

    def __init__(self) -> None:
        self.sources: list[ReuseSource] = []
        self.stale: list[bytes] = []
        self.similarity = self.embedded = self.lookup_ms = None


def _donor_sources(prompt, tokens: tuple[int, ...], max_tokens: int, lookup: "Lookup", store, adapter,
                   config, found: _Found) -> None:
    """Step 3a: the donors that may be served whole (sharing the context before the embedded
    text), most similar first."""
    context = context_len(prompt, tokens, lookup.embedded[0], adapter)
    for donor in lookup.donors:
        if donor.similarity < config.similarity_exact:
            break
        if common_prefix_len(tokens, donor.tokens) < context:
            continue
        d_tokens = tuple(int(t) for t in donor.tokens)
        if len(d_tokens) + max_tokens > adapter.n_ctx:
            continue
        d_walk = walk(store, adapter.namespace, d_tokens)
        whole = adapter.usable_prefix(len(d_tokens) - 1, len(d_tokens))
        if d_walk.matched_tokens < whole:  # part of its chain expired or was refused
            log.info("donor %s: %d of its %d tokens are stored; not served", donor.key.hex()[:16],
                     d_walk.matched_tokens, len(d_tokens))
            if d_walk.matched_tokens == 0:
                found.stale.append(donor.key)
            continue
        found.sources.append(ReuseSource(SourceKind.DONOR, d_tokens, d_walk, len(d_tokens), adapter.namespace,
                                         required=whole, donor=donor.key.hex()))


def _verified_prefix(tokens: tuple[int, ...], donors: "Sequence[Donor]", match: PrefixMatch, limit: int,
                     store, namespace: Namespace) -> tuple[PrefixMatch, int, bytes | None]:
    """Step 3b; returns (match, verified tokens, donor key)."""
    donor_key = None
    for donor in donors:
        common = common_prefix_len(tokens, donor.tokens)
        if common < max(limit, MIN_SPAN):
            continue
        donor_match = walk(store, namespace, donor.tokens)
        verified = min(donor_match.matched_tokens, common)
        if verified > limit:
            match, limit, donor_key = donor_match, verified, donor.key
        elif verified == limit and donor_key is None:
            donor_key = donor.key
    return match, limit, donor_key


def convertible_namespaces(store: "FragmentBackend", namespace: Namespace) -> list[Namespace]:
    """The store's namespaces whose KV ``compatible_with`` calls convertible for an engine of
    ``namespace`` (same model and geometry, another engine or settings); the others are
    skipped with their reason logged. Empty when the store cannot be read."""
    try:
        stored = store.namespaces()
    except StoreError as exc:
        log.warning("store unreadable, no cross-engine lookup: %s", exc)
        return []
    usable = []
    for ns in stored:
        if ns == namespace:
            continue
        verdict = compatible_with(ns, namespace)
        if verdict.verdict == CONVERTIBLE:
            usable.append(ns)
        else:
            log.debug("stored %s KV not usable here: %s", ns.engine, verdict.reason)
    return usable


def _convertible_source(tokens: tuple[int, ...], own: int, store, adapter) -> ReuseSource | None:
    """Step 4 (the first such namespace on a tie; ``own``: tokens the own namespace yields)."""
    best = None
    for ns in convertible_namespaces(store, adapter.namespace):
        match = walk(store, ns, tokens)
        usable = adapter.usable_prefix(match.matched_tokens, len(tokens))
        if usable > (best[0] if best else own):
            best = (usable, ns, match)
    if best is None:
        return None
    _, ns, match = best
    return ReuseSource(SourceKind.CONVERTIBLE, tokens, match, match.matched_tokens, ns, required=own + 1)


def context_len(prompt, tokens: Sequence[int], text: str, adapter: "EngineAdapter") -> int:
    """Prompt tokens before the embedded ``text``: for chat messages ending with a user turn,
    everything up to that turn's content (found by rendering the messages with that content
    emptied); otherwise all but the embedded text's own tokens and 8 more (the template's
    closing tokens and tokenizer boundary effects)."""
    if not isinstance(prompt, str) and prompt and prompt[-1].get("role") == "user":
        emptied = list(prompt[:-1]) + [{**prompt[-1], "content": ""}]
        try:
            return common_prefix_len(tokens, adapter.tokenize(adapter.apply_chat_template(emptied)))
        except (ValueError, TypeError) as exc:
            log.debug("chat template of the emptied turn failed (%s); estimating", exc)
    return max(0, len(tokens) - len(adapter.tokenize(text)) - 8)
