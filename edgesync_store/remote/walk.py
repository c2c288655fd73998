"""The prefix walk and the fragments-along-a-prompt query over the remote tier's index.

The same rules as the local walk (``core/walk.py``): at each position the fragments stored
after exactly this prefix (namespace digest + prefix hash) are grouped by span, a group counts
when it holds every layer and KV head of the namespace and its token IDs match the prompt's,
and the walk returns the path that reaches furthest (depth first, spans of other chunk sizes
branch). Headers come from the index hash (``tier.KeyLayout``), never from blobs; a blob that
no longer exists (Redis expired or evicted it) does not count, and its field is reported for
removal.

Round trips: the positions of the chunk grid (``grid`` tokens apart, the configured
``chunk_tokens``) are looked up together in one pipeline, and their blobs' existence in a
second; a position off the grid (a chain of another chunk size) costs two more. A walk over a
342-token prompt stored in 128-token chunks is two round trips.

The lookup function is given by the caller (:class:`~edgesync_store.remote.tiered.TieredStore`),
so this module sends nothing itself.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from edgesync_store.core.codec import FragmentHeader
from edgesync_store.core.walk import PrefixMatch, SpanMatch, longest_chain
from edgesync_store.schema import MIN_SPAN, Namespace, common_prefix_len, prefix_hasher, token_bytes

Candidate = tuple[bytes, FragmentHeader, int]
"""(store key, header, blob bytes) of one live fragment stored after a prefix."""
Lookup = Callable[[Sequence[bytes]], list[list[Candidate]]]
"""prefix hashes -> for each, the live fragments of the walk's namespace stored after it."""

__all__ = ["Candidate", "Lookup", "keys_along", "prefix_walk"]


def _grid_digests(tokens: np.ndarray, grid: int) -> dict[int, bytes]:
    """Prefix hashes at positions 0, grid, 2 grid, ... below ``len(tokens)``."""
    hasher, out = prefix_hasher(), {}
    for pos in range(0, len(tokens), grid):
        out[pos] = hasher.digest()
        hasher.update(token_bytes(tokens[pos : pos + grid]))
    return out


def _spans(candidates: list[Candidate], tokens: np.ndarray, pos: int, want: tuple[dict, set]) -> list[SpanMatch]:
    """Complete-coverage span groups among ``candidates`` at ``pos`` whose tokens match."""
    ns_dict, full = want
    groups: dict[tuple[int, bytes], list] = {}
    for key, head, nbytes in candidates:
        if head.namespace.to_dict() != ns_dict or head.token_start != pos:
            continue
        group = groups.setdefault((head.token_end, head.token_ids.tobytes()), [head, set(), [], 0])
        group[1].update((layer, h) for layer in head.layers for h in range(head.head_start, head.head_end))
        group[2].append(key)
        group[3] += nbytes
    spans = []
    for head, covered, keys, nbytes in groups.values():
        if covered == full:
            matched = common_prefix_len(head.token_ids, tokens[pos : head.token_end])
            if matched > 0:
                spans.append(SpanMatch(keys, pos, head.token_end, matched, nbytes))
    return spans


def prefix_walk(lookup: Lookup, namespace: Namespace, tokens: Sequence[int] | np.ndarray, grid: int = 128
                ) -> PrefixMatch:
    """The longest run of remote fragments of ``namespace`` matching ``tokens`` from position 0.

    Args:
        lookup: the remote lookup (module docstring); its errors propagate.
        namespace: only its fragments count.
        tokens: the prompt's token IDs.
        grid: the chunk size whose positions are looked up in one batch (tokens).
    """
    tokens = np.asarray(tokens, dtype=np.int32)
    want = (namespace.to_dict(), {(layer, h) for layer in range(namespace.n_layer)
                                  for h in range(namespace.n_head_kv)})
    batch = _grid_digests(tokens, max(1, grid))
    found = dict(zip(batch, lookup(list(batch.values())))) if batch else {}

    def at(pos: int, digest: bytes) -> list[SpanMatch]:
        if pos not in found:
            found[pos] = lookup([digest])[0]
        return _spans(found[pos], tokens, pos, want)

    return PrefixMatch(spans=longest_chain(tokens, at))


def keys_along(lookup: Lookup, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
    """Every remote fragment of ``namespace`` that the prompt ``tokens`` wrote or could hit (the
    rule of ``core/walk.keys_along``: it follows a prefix of ``tokens`` and its tokens match for
    at least one token, ``MIN_SPAN`` at position 0). One lookup of every position, in one batch."""
    tokens = np.asarray(tokens, dtype=np.int32)
    hasher, digests = prefix_hasher(), []
    for pos in range(len(tokens)):
        digests.append(hasher.digest())
        hasher.update(token_bytes(tokens[pos : pos + 1]))
    ns_dict, found = namespace.to_dict(), []
    for pos, candidates in enumerate(lookup(digests) if digests else []):
        for key, head, _nbytes in candidates:
            if head.namespace.to_dict() != ns_dict or head.token_start != pos:
                continue
            need = 1 if pos else min(MIN_SPAN, head.span)
            if common_prefix_len(head.token_ids, tokens[pos : pos + head.span]) >= need:
                found.append(key)
    return found
