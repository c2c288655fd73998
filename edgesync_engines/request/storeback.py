"""After an answer: store the prompt's missing chunks, index the prompt as a donor, record hits.

The prompt's own chunk grid is ``schema.chunk_spans(len(tokens) - 1, chunk_tokens)``: chunks
cover the prompt but its last token, whose KV came from a one-token evaluation (see
``LlamaCppAdapter.usable_prefix``). :func:`chunk_key` names a chunk of that grid; the prefetch
predictor keys requests by the first chunk, the semantic index keys donors by the last.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import numpy as np

from edgesync_store.errors import StoreError
from edgesync_store.lifecycle.merge import group_ranges, split_heads, split_layers
from edgesync_store.schema import Namespace, chunk_spans, prefix_hash, store_key

if TYPE_CHECKING:
    from edgesync_engines.adapters.protocol import EngineAdapter
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.semantic_lookup import SemanticLookup
    from edgesync_store.core.store import FragmentStore

log = logging.getLogger(__name__)


def chunk_key(namespace: Namespace, tokens: Sequence[int] | np.ndarray, chunk_tokens: int = 128, *,
              last: bool = False, layers_per_fragment: int | None = None,
              heads_per_fragment: int | None = None) -> bytes | None:
    """Store key of the first (or ``last``) chunk of the prompt's own chunk grid: the key of
    its first fragment under the given grouping (layer group 0 x head group 0; the whole
    chunk, all layers and heads, when both are None). None for a prompt too short to be cached
    (under 65 tokens).

    Raises:
        ValueError: a ``chunk_tokens`` outside ``chunk_spans``' range, or a grouping that
            ``group_ranges`` refuses.
    """
    spans = chunk_spans(len(tokens) - 1, chunk_tokens)
    if not spans:
        return None
    s, e = spans[-1] if last else spans[0]
    (l0, l1), (h0, h1) = group_ranges(namespace, layers_per_fragment, heads_per_fragment)[0]
    ids = np.asarray(tokens[s:e], dtype=np.int32)
    return store_key(namespace, prefix_hash(tokens[:s]), ids, s, l0, l1, 1, h0, h1)


def donor_key(namespace: Namespace, tokens: Sequence[int], config: "EdgeSyncConfig") -> bytes | None:
    """The semantic index's key of a prompt: the key of the last chunk of its grid under the
    configured ``chunk_tokens``, ``layers_per_fragment`` and ``heads_per_fragment``."""
    return chunk_key(namespace, tokens, config.chunk_tokens, last=True,
                     layers_per_fragment=config.layers_per_fragment, heads_per_fragment=config.heads_per_fragment)


def store_new(store: "FragmentStore", adapter: "EngineAdapter", tokens: list[int], config: "EdgeSyncConfig") -> int:
    """Extract and store the prompt's chunks that the store lacks (or holds expired); return
    how many fragments were written (0, with a warning, when the store or the engine failed).

    Every chunk of the prompt's own grid is kept, even where fragments of another chunk size
    hold the same tokens, so that the prompt's chain from position 0 is complete and an exact
    repeat injects all of it.

    A chunk counts as stored when live fragments of exactly its span together hold every layer
    and KV head, whatever their grouping (``covers_span``). Missing chunks are extracted whole
    (one seq-state read for all) and cut into the configured ``layers_per_fragment`` x
    ``heads_per_fragment`` groups; all fragments of all chunks go in one ``put_many`` (one write
    transaction, so no reader sees half a chunk).
    """
    ns = adapter.namespace
    try:
        spans = [
            (s, e)
            for s, e in chunk_spans(len(tokens) - 1, config.chunk_tokens)
            if not store.covers_span(ns, prefix_hash(tokens[:s]), tokens[s:e], s)
        ]
        if not spans:
            return 0
        (l0, l1), (h0, h1) = group_ranges(ns, config.layers_per_fragment, config.heads_per_fragment)[0]
        wholes = adapter.extract_fragments(tokens, spans, ttl_seconds=config.ttl_seconds, now=store.clock())
        fragments = [
            part
            for whole in wholes
            for layer_part in split_layers(whole, l1 - l0)
            for part in split_heads(layer_part, h1 - h0)
        ]
        return store.put_many(fragments)
    except (StoreError, OSError, ValueError) as exc:
        log.warning("could not store fragments, serving uncached: %s", exc)
        return 0


def index_prompt(semantic: "SemanticLookup", store: "FragmentStore", namespace: Namespace, prompt,
                 tokens: list[int], embedded, config: "EdgeSyncConfig") -> None:
    """Index the prompt as a donor (after its answer, off the TTFT path) when its chain is
    stored and it is not indexed yet. ``embedded``: the lookup's (text, vector) of this
    request, None when the lookup did not run (then the prompt is embedded here, unless the
    embedder is still loading: the request does not wait for it)."""
    if embedded is None and not semantic.ready_now():
        return
    key = donor_key(namespace, tokens, config)
    try:
        if key is None or not store.is_live(key) or semantic.contains(key):
            return
    except StoreError as exc:
        log.warning("could not index the prompt: %s", exc)
        return
    semantic.remember(key, namespace, tokens, prompt, embedded)


def record_hits(store: "FragmentStore", keys: Sequence[bytes]) -> None:
    """Count a hit on each injected fragment (for eviction and merging); a failure is logged."""
    try:
        store.record_hits(keys)
    except (StoreError, OSError) as exc:
        log.warning("could not record hits: %s", exc)
