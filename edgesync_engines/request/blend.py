"""Blended injection (``reuse="blend"``): for a ``DocumentPrompt`` (head, documents, question),
:func:`blend` leaves the engine holding KV for ``tokens[:question_start]``:

1. **Head, exact**, injected from the prefix walk or prefilled before any other cell is in the
   cache (a decode beside foreign cells is not bit-identical: ../shared/DESIGN.md 2.6).
2. **Documents, placed**: each stored chain restored in a scratch sequence, moved to the
   document's offset and added to the main sequence (``EngineAdapter.place_kv``).
3. **Runs, recomputed** against everything before them (``EngineAdapter.recompute``): per
   document, the separator before it and its first ``ceil(share * n)`` tokens
   (``blend_recompute``), where standalone KV differs most. A document with no stored KV is
   recomputed whole.

The question is then prefilled by ``generate``. Anything that fails clears the sequence and
returns None: the request then prefills exactly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgesync_engines.adapters.protocol import InjectionError
from edgesync_engines.request import plan as planning
from edgesync_engines.request import storeback
from edgesync_engines.request.plan import ReuseSource, SourceKind
from edgesync_store.errors import StoreError

if TYPE_CHECKING:
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.execute import Injector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Blended:
    """What :func:`blend` left in the engine.

    Attributes:
        n_past: positions the engine holds (``question_start``).
        head_reused: head tokens injected from the store (the rest of the head was prefilled).
        blended_tokens: document tokens whose stored KV was kept as placed.
        recomputed_tokens: document and separator tokens evaluated against the assembled prompt.
        keys: store keys of the fragments injected or placed (their hits are recorded).
        bytes_read: their compressed bytes.
    """

    n_past: int
    head_reused: int
    blended_tokens: int
    recomputed_tokens: int
    keys: tuple[bytes, ...]
    bytes_read: int


def recompute_runs(prompt, placed: list[bool], share: float) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs evaluated again, in prompt order (module docstring, step 3):
    per document, from the end of the previous one (or of the head) to ``ceil(share * n)``
    tokens into it, or to its end when it was not placed. Empty runs are left out."""
    runs, prev_end = [], prompt.head_len
    for (rec, offset), ok in zip(prompt.pieces, placed):
        n = len(rec.tokens)
        end = offset + (min(n, math.ceil(share * n)) if ok else n)
        if end > prev_end:
            runs.append((prev_end, end))
        prev_end = offset + n
    return runs


def blend(prompt, injector: "Injector", config: "EdgeSyncConfig") -> Blended | None:
    """Assemble ``prompt``'s head and documents in the engine (module docstring), recomputing
    ``config.blend_recompute`` of each document. Returns None, with the sequence cleared, when
    the blend failed; the caller prefills instead."""
    adapter = injector.adapter
    tokens = list(prompt.tokens)
    adapter.clear_kv_cache()
    try:
        head_reused, keys, nbytes = _head(prompt, injector, config)
        placed = []
        for rec, offset in prompt.pieces:
            got = _place(rec, offset, tokens, injector)
            placed.append(got is not None)
            if got is not None:
                keys += got[0]
                nbytes += got[1]
        runs = recompute_runs(prompt, placed, config.blend_recompute)
        for start, end in runs:
            adapter.recompute(tokens, start, end)
    except (InjectionError, ValueError, StoreError) as exc:
        log.warning("blend failed, prefilling exactly: %s", exc)
        adapter.clear_kv_cache()
        return None
    recomputed = sum(e - s for s, e in runs)
    doc_tokens = sum(len(rec.tokens) for rec, _ in prompt.pieces)
    separators = prompt.question_start - prompt.head_len - doc_tokens
    return Blended(prompt.question_start, head_reused, doc_tokens + separators - recomputed, recomputed,
                   tuple(keys), nbytes)


def _head(prompt, injector: "Injector", config) -> tuple[int, list[bytes], int]:
    """Step 1: inject the head's stored prefix and prefill the rest of it (storing its new
    chunks while the cache holds nothing else); returns (tokens injected, keys, bytes)."""
    adapter, tokens = injector.adapter, prompt.tokens
    match = planning.walk(injector.store, adapter.namespace, tokens)
    source = ReuseSource(SourceKind.PREFIX, tokens, match, prompt.head_len, adapter.namespace)
    reused, keys, nbytes = injector.inject(source) if prompt.head_len else (0, [], 0)
    if reused < prompt.head_len:
        adapter.prefill(list(tokens[:prompt.head_len]), reused)
        storeback.store_new(injector.store, adapter, list(tokens[:prompt.head_len + 1]), config)
    return reused, list(keys), nbytes


def _place(rec, offset: int, tokens: list[int], injector: "Injector") -> tuple[list[bytes], int] | None:
    """Step 2 for one document: its stored chain placed at ``offset``; None when its chain is
    not all stored (it is then recomputed whole)."""
    adapter, store = injector.adapter, injector.store
    chain = rec.chain
    match = planning.walk(store, adapter.namespace, chain)
    if match.matched_tokens < len(chain):
        return None
    keys = [key for span in match.spans for key in span.keys]
    with store.pins.pinned(keys), injector.fetched(match, len(chain)) as got:
        if got.missing or got.covered < len(chain):
            return None
        adapter.place_kv(got.fragments, chain, (len(rec.header), len(chain)), offset, tokens)
    return got.keys, got.nbytes
