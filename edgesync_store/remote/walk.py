"""The prefix walk and the fragments-along-a-prompt query over the remote tier's index, and the
walk over both tiers at once.

The rules are the local walk's (``core/walk``); headers come from the index hash, never blobs; a
field whose blob is gone does not count and is reported for removal. Positions of the chunk grid,
the prompt's last position and the local chain's ends go in one pipeline, their blobs' existence
in a second. The ``lookup`` function is the caller's (``TieredStore``): nothing is sent here.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from edgesync_store.core.codec import FragmentHeader
from edgesync_store.core.walk import PrefixMatch, SpanMatch, longest_chain
from edgesync_store.schema import MIN_SPAN, Namespace, common_prefix_len, prefix_hasher, token_bytes

Candidate = tuple[bytes, FragmentHeader, int]
"""(store key, header, blob bytes) of one live fragment stored after a prefix."""
Lookup = Callable[[Sequence[bytes]], list[list[Candidate]]]
"""prefix hashes -> for each, the live fragments of the walk's namespace stored after it."""
SpansAt = Callable[[int, bytes], list[SpanMatch]]
"""(position, prefix hash) -> the complete span groups stored there (``core.walk.longest_chain``)."""

__all__ = ["Candidate", "Lookup", "SpansAt", "combined_walk", "keys_along", "prefix_walk"]


def _digests_at(tokens: np.ndarray, positions: Iterable[int]) -> dict[int, bytes]:
    """Prefix hashes of ``tokens[:pos]`` for each of ``positions`` (below ``len(tokens)``), in
    position order, hashing the prompt once."""
    hasher, out, at = prefix_hasher(), {}, 0
    for pos in sorted(set(positions)):
        hasher.update(token_bytes(tokens[at:pos]))
        out[pos], at = hasher.digest(), pos
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


def _remote_spans(lookup: Lookup, namespace: Namespace, tokens: np.ndarray, grid: int,
                  also: Iterable[int] = ()) -> SpansAt:
    """The remote ``spans_at``: the grid positions, the last one and ``also`` are looked up now
    in one batch (module docstring), any other position when the walk asks for it."""
    want = (namespace.to_dict(), {(layer, h) for layer in range(namespace.n_layer)
                                  for h in range(namespace.n_head_kv)})
    n = len(tokens)
    batch = _digests_at(tokens, [*range(0, n, max(1, grid)), *([n - 1] if n else []),
                                 *(p for p in also if 0 <= p < n)])
    found = dict(zip(batch, lookup(list(batch.values())))) if batch else {}

    def at(pos: int, digest: bytes) -> list[SpanMatch]:
        if pos not in found:
            found[pos] = lookup([digest])[0]
        return _spans(found[pos], tokens, pos, want)

    return at


def prefix_walk(lookup: Lookup, namespace: Namespace, tokens: Sequence[int] | np.ndarray, grid: int = 128
                ) -> PrefixMatch:
    """The longest run of remote fragments of ``namespace`` matching ``tokens`` from position 0.
    ``grid``: the chunk size (tokens) whose positions are looked up in one batch; ``lookup``'s
    errors propagate."""
    tokens = np.asarray(tokens, dtype=np.int32)
    return PrefixMatch(spans=longest_chain(tokens, _remote_spans(lookup, namespace, tokens, grid)))


def combined_walk(lookup: Lookup, local_at: SpansAt, local: PrefixMatch, namespace: Namespace,
                  tokens: Sequence[int] | np.ndarray, grid: int = 128) -> tuple[PrefixMatch, int]:
    """The chain reaching furthest into ``tokens`` when at each position the span groups of either
    tier count (local first: a tie needs no fetch). ``local_at``: the local tier's ``spans_at``;
    ``local``: the local walk of ``tokens`` (its span ends join the first remote batch); ``grid``:
    the chunk size in tokens. ``lookup``'s errors propagate (``RemoteUnavailable``: use the local
    walk). Returns (the chain, how many of its spans are the remote tier's)."""
    tokens = np.asarray(tokens, dtype=np.int32)
    remote_at = _remote_spans(lookup, namespace, tokens, grid, [s.token_end for s in local.spans if s.complete])
    offered: list[SpanMatch] = []

    def at(pos: int, digest: bytes) -> list[SpanMatch]:
        mine = local_at(pos, digest)
        seen = {(s.token_end, frozenset(s.keys)) for s in mine}
        theirs = [s for s in remote_at(pos, digest) if (s.token_end, frozenset(s.keys)) not in seen]
        offered.extend(theirs)
        return mine + theirs

    spans = longest_chain(tokens, at)
    return PrefixMatch(spans=spans), sum(any(s is r for r in offered) for s in spans)


def keys_along(lookup: Lookup, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
    """Every remote fragment of ``namespace`` the prompt ``tokens`` wrote or could hit (the rule of
    ``core/walk.keys_along``), in one batch."""
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
