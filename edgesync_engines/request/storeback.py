"""After an answer: store the prompt's missing chunks with its donor record, record hits, and
(semantic mode) give the prompt its vector.

The prompt's chunk grid is ``schema.chunk_spans(len(tokens) - 1, chunk_tokens)`` (never the last
token: ``usable_prefix``). The donor record goes in the same write as the fragments, without a
vector: nothing is embedded on the default path.

A context whose KV cannot fit the store's size budget is not stored at all, decided before its
KV is extracted (:func:`context_kv_bytes`): one warning names both sizes, and the answer is
unaffected. Storing part of it would evict everything else for a chain that a repeat reads only
in part, and the rest would never fit.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import numpy as np

from edgesync_engines.request.prompt_text import embed_text_for
from edgesync_store.core.donor_record import donor_value
from edgesync_store.errors import StoreBudgetError, StoreError, sized
from edgesync_store.lifecycle.merge import group_ranges, split_heads, split_layers
from edgesync_store.schema import Namespace, chunk_spans, prefix_hash, store_key

if TYPE_CHECKING:
    from edgesync_engines.adapters.protocol import EngineAdapter
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.fragment_cache import FragmentCache
    from edgesync_engines.request.semantic_lookup import SemanticLookup
    from edgesync_store.core.backend import FragmentBackend

log = logging.getLogger(__name__)

_REFUSED: OrderedDict[tuple, None] = OrderedDict()
"""Contexts refused for their size lately (budget, first chunk's key), most recent last: a context
refused again (an idle store-back refuses the same growing conversation at every chunk) is
logged at DEBUG, not warned about again."""
_REFUSED_KEPT = 64
_REFUSED_LOCK = threading.Lock()


def context_kv_bytes(namespace: Namespace, n_tokens: int) -> int:
    """Bytes of K and V that ``n_tokens`` tokens of ``namespace``'s KV take, as the engine holds
    them (before any compression): 2 (K and V) x layers x KV heads x a head's row width x its
    item size x tokens. Llama-3.1-8B in f16: 2 x 32 x 8 x 128 x 2 = 128 KiB a token, 4 GiB for
    32,768 tokens; SmolLM2-135M: 22.5 KiB a token (DESIGN.md 2.10)."""
    ns = namespace
    return 2 * ns.n_layer * ns.n_head_kv * ns.head_width * ns.np_dtype.itemsize * int(n_tokens)


def chunk_key(namespace: Namespace, tokens: Sequence[int] | np.ndarray, chunk_tokens: int = 128, *,
              last: bool = False, layers_per_fragment: int | None = None,
              heads_per_fragment: int | None = None) -> bytes | None:
    """Store key of the first (or ``last``) chunk of the prompt's own chunk grid: the key of
    its first fragment under the given grouping (layer group 0 x head group 0; the whole
    chunk, all layers and heads, when both are None). None for a prompt too short to be cached
    (under 65 tokens).

    Raises ValueError for a ``chunk_tokens`` or grouping ``chunk_spans``/``group_ranges`` refuse.
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


def store_new(store: "FragmentBackend", adapter: "EngineAdapter", tokens: list[int], config: "EdgeSyncConfig",
              donor_prompt=None, ram: "FragmentCache | None" = None,
              spans: "Sequence[tuple[int, int]] | None" = None) -> int:
    """Store the prompt's grid chunks that the store lacks (or holds expired) and return how
    many fragments were written (0, with a warning, when the store or the engine failed).

    A chunk is stored when live fragments of exactly its span hold every layer and KV head
    (``covers_span``); fragments of other chunk sizes do not count, so an exact repeat injects
    one chain from 0. Missing chunks are written in one ``put_many`` with the donor record of
    ``donor_prompt`` (a string or chat messages). ``ram``: the RAM tier keeps them too, unless
    the store serves in place. ``spans``: chunks to store instead of the grid (inside the live sequence).

    Spans are extracted and written in :func:`write_batches` (one ``put_many`` each, the donor
    record with the last), so a long context is never held whole beside the engine's KV cache;
    the batches before a failed one stay stored (a prefix of the chain).

    A context whose KV (the grid's tokens, :func:`context_kv_bytes`) exceeds the store's
    ``max_bytes``, or whose blobs the store refuses as larger than its budget
    (``StoreBudgetError``), writes nothing, with one warning naming both sizes.
    """
    ns = adapter.namespace
    try:
        asked = spans
        spans = [
            (s, e)
            for s, e in (chunk_spans(len(tokens) - 1, config.chunk_tokens) if spans is None else spans)
            if not store.covers_span(ns, prefix_hash(tokens[:s]), tokens[s:e], s)
        ]
        if spans and _too_large(store, ns, tokens, config, asked):  # nothing missing: nothing to refuse
            return 0
        donor = None if donor_prompt is None or store.readonly else _donor_record(ns, tokens, config, donor_prompt)
        if not spans:
            if donor is not None:
                store.put_donor(*donor)  # a store written before donor records came with the fragments
            return 0
        (l0, l1), (h0, h1) = group_ranges(ns, config.layers_per_fragment, config.heads_per_fragment)[0]
        written, batches = 0, write_batches(ns, spans)
        for i, batch in enumerate(batches):
            wholes = adapter.extract_fragments(tokens, batch, ttl_seconds=config.ttl_seconds, now=store.clock())
            fragments = [
                adapter.stage_fragment(part)  # V stored as the engine injects it: a hit copies rows
                for whole in wholes
                for layer_part in split_layers(whole, l1 - l0)
                for part in split_heads(layer_part, h1 - h0)
            ]
            done = store.put_many(fragments, donor=donor if i == len(batches) - 1 else None)
            if ram is not None and done and not store.serves_in_place:
                ram.keep_stored(fragments)
            written += done
        return written
    except StoreBudgetError as exc:
        held = f" beside {sized(exc.held)} it cannot evict (pinned by requests reading them)" if exc.held else ""
        _refuse(store, ns, tokens, config, f"its fragments take {sized(exc.nbytes)}, more than the store's size budget "
                                           f"of {sized(exc.max_bytes)}{held}")
        return 0
    except (StoreError, OSError, ValueError) as exc:
        log.warning("could not store fragments, serving uncached: %s", exc)
        return 0


WRITE_BATCH_BYTES = 16 << 20
"""KV bytes one store-back extracts and writes at a time: the batch's seq state, its fragments,
their staged V, encoded blobs and LMDB's uncommitted pages each hold about this much, whatever
the context's size."""


def write_batches(ns: Namespace, spans: Sequence[tuple[int, int]],
                  limit: int | None = None) -> list[list[tuple[int, int]]]:
    """``spans`` in order, cut into runs of at most ``limit`` KV bytes (default
    :data:`WRITE_BATCH_BYTES`; :func:`context_kv_bytes` of their tokens; a span larger than
    ``limit`` is a run of its own)."""
    limit = WRITE_BATCH_BYTES if limit is None else limit
    batches: list[list[tuple[int, int]]] = []
    held = limit
    for s, e in spans:
        size = context_kv_bytes(ns, e - s)
        if held + size > limit:
            batches.append([])
            held = 0
        batches[-1].append((s, e))
        held += size
    return batches


def _too_large(store: "FragmentBackend", ns: Namespace, tokens: list[int], config: "EdgeSyncConfig",
               spans: "Sequence[tuple[int, int]] | None") -> bool:
    """True (the refusal logged) when the KV of the context's grid, or of ``spans`` reaching
    further, exceeds the store's budget; False when it may fit or the store has no budget."""
    budget = getattr(store, "max_bytes", None)
    if not budget:
        return False
    try:
        grid = chunk_spans(len(tokens) - 1, config.chunk_tokens)
    except ValueError:
        return False  # a bad chunk size: store_new says so
    n_tokens = max([e for _, e in grid] + [e for _, e in spans or ()], default=0)
    nbytes = context_kv_bytes(ns, n_tokens)
    if nbytes <= budget:
        return False
    _refuse(store, ns, tokens, config, f"its KV ({n_tokens} tokens) is {sized(nbytes)}, more than the store's size "
                                       f"budget of {sized(budget)}")
    return True


def _refuse(store: "FragmentBackend", ns: Namespace, tokens: list[int], config: "EdgeSyncConfig", why: str) -> None:
    """Log that the context is not stored: a warning, or DEBUG when the same context (its first
    chunk) was refused lately under the same budget."""
    try:
        first = chunk_key(ns, tokens, config.chunk_tokens)
    except ValueError:
        first = None
    seen = (getattr(store, "max_bytes", None), first)
    with _REFUSED_LOCK:
        again = seen in _REFUSED
        _REFUSED[seen] = None
        _REFUSED.move_to_end(seen)
        while len(_REFUSED) > _REFUSED_KEPT:
            _REFUSED.popitem(last=False)
    text = "not storing this context: %s; the request is answered, its KV is not stored (a larger max_bytes, " \
           "EDGESYNC_MAX_BYTES, keeps it)"
    if again and first is not None:
        log.debug(text, why)
    else:
        log.warning(text, why)


def _donor_record(namespace: Namespace, tokens: list[int], config: "EdgeSyncConfig",
                  prompt) -> tuple[bytes, bytes] | None:
    """(key, value) of the prompt's donor record, or None: too short to be cached, or nothing
    to embed."""
    key = donor_key(namespace, tokens, config)
    text = embed_text_for(prompt) if key is not None else ""
    if not text.strip():
        return None
    return key, donor_value(namespace.digest(), tokens, text)


def index_prompt(semantic: "SemanticLookup", store: "FragmentBackend", namespace: Namespace, prompt,
                 tokens: list[int], embedded, config: "EdgeSyncConfig") -> None:
    """Give the prompt's donor its vector now (after its answer) when the semantic lookup ran
    for this request (``embedded``: its (text, float32 ``[384]`` embedding); None does nothing:
    the catch-up embeds it later), its chain is stored and it is not indexed yet."""
    if embedded is None or not semantic.ready_now():
        return
    key = donor_key(namespace, tokens, config)
    try:
        if key is None or not store.is_live(key) or semantic.contains(key):
            return
    except StoreError as exc:
        log.warning("could not index the prompt: %s", exc)
        return
    semantic.remember(key, namespace, tokens, prompt, embedded)


def record_hits(store: "FragmentBackend", keys: Sequence[bytes],
                reused: tuple[bytes, Sequence[int]] | None = None) -> None:
    """Count a hit on each injected fragment (for eviction and merging) and keep ``reused``
    (namespace digest, the token IDs injected) as the store's reuse hint; a failure is logged."""
    try:
        store.record_hits(keys, reused=reused)
    except (StoreError, OSError) as exc:
        log.warning("could not record hits: %s", exc)
