"""The prefix index's queries over an open ``FragmentStore``: the walk that finds a prompt's
stored KV (:func:`longest_chain`, shared with the remote tier's walk), one span's coverage, the
fragments along a prompt (what ``forget`` removes) and the namespaces stored. They read heads,
``by_prefix`` and ``lifecycle`` only (no blob is mapped), one read transaction each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from edgesync_store.core import codec
from edgesync_store.errors import CodecError
from edgesync_store.schema import MIN_SPAN, Namespace, common_prefix_len, prefix_hasher, token_bytes
from edgesync_store.ttl import Lifecycle


def index_key(namespace_digest: bytes, prefix_hash: bytes) -> bytes:
    """The ``by_prefix`` key of a fragment: its namespace digest (32 bytes) + prefix hash (32)."""
    return namespace_digest + prefix_hash


@dataclass
class SpanMatch:
    """One step of a prefix walk: the fragments that together hold every layer and head of
    ``[token_start, token_end)``, of which the first ``matched`` tokens equal the prompt's."""

    keys: list[bytes]
    token_start: int
    token_end: int
    matched: int
    compressed_nbytes: int

    @property
    def complete(self) -> bool:
        """True when every token of the span matched."""
        return self.matched == self.token_end - self.token_start


@dataclass
class PrefixMatch:
    """Result of :meth:`FragmentStore.prefix_walk`: spans in token order from position 0."""

    spans: list[SpanMatch] = field(default_factory=list)

    @property
    def matched_tokens(self) -> int:
        """Prompt tokens, from position 0, whose KV the store holds."""
        return self.spans[-1].token_start + self.spans[-1].matched if self.spans else 0


def covers_span(store, namespace: Namespace, prefix: bytes, token_ids: Sequence[int] | np.ndarray,
                token_start: int, now: float | None = None) -> bool:
    """True when live fragments of exactly the span ``[token_start, token_start +
    len(token_ids))`` after the prefix hash ``prefix``, with these token IDs, together hold
    every layer and KV head of ``namespace`` (one fragment or several layer/head groups)."""
    now = store.clock() if now is None else now
    ids = np.asarray(token_ids, dtype=np.int32)
    end = token_start + len(ids)
    ns_dict = namespace.to_dict()
    full = namespace.n_layer * namespace.n_head_kv

    def read(txn) -> bool:
        cursor = txn.cursor(db=store.env.by_prefix)
        if not cursor.set_key(index_key(namespace.digest(), bytes(prefix))):
            return False
        covered: set[tuple[int, int]] = set()
        for key in cursor.iternext_dup():
            head_bytes = store.env.head_in(txn, bytes(key))
            if head_bytes is None or Lifecycle.unpack(txn.get(key, db=store.env.lifecycle)).expired(now):
                continue
            try:
                head = codec.peek(head_bytes)
            except CodecError:
                continue
            if (head.token_start != token_start or head.token_end != end
                    or head.namespace.to_dict() != ns_dict or not np.array_equal(head.token_ids, ids)):
                continue
            covered.update((layer, h) for layer in head.layers for h in range(head.head_start, head.head_end))
        return len(covered) == full

    return store.transact(read)

def keys_along(store, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
    """Every stored fragment (live or expired) that follows a prefix of ``tokens`` and matches
    them for at least one token (at position 0: ``MIN_SPAN``, since nothing shorter is
    injected). One ``by_prefix`` lookup per prompt position."""
    tokens = np.asarray(tokens, dtype=np.int32)
    ns_digest = namespace.digest()
    ns_dict = namespace.to_dict()

    def read(txn) -> list[bytes]:
        cursor = txn.cursor(db=store.env.by_prefix)
        hasher, found = prefix_hasher(), []
        for pos in range(len(tokens)):
            if cursor.set_key(index_key(ns_digest, hasher.digest())):
                for key in [bytes(k) for k in cursor.iternext_dup()]:
                    head_bytes = store.env.head_in(txn, key)
                    try:
                        head = codec.peek(head_bytes) if head_bytes is not None else None
                    except CodecError:
                        head = None
                    if head is None or head.namespace.to_dict() != ns_dict or head.token_start != pos:
                        continue
                    # at position 0 a fragment serves only from MIN_SPAN matched tokens
                    # on (shorter prefixes are never injected); later, one token adds to
                    # the chain it extends
                    need = 1 if pos else min(MIN_SPAN, head.span)
                    if common_prefix_len(head.token_ids, tokens[pos : pos + head.span]) >= need:
                        found.append(key)
            hasher.update(token_bytes(tokens[pos : pos + 1]))
        return found

    return store.transact(read)


def stored_namespaces(store) -> list[Namespace]:
    """The namespaces of the fragments stored at position 0, in no order (one pass over the
    index keys, one header per namespace)."""
    empty = prefix_hasher().digest()

    def read(txn) -> list[Namespace]:
        cursor = txn.cursor(db=store.env.by_prefix)
        found: dict[bytes, Namespace] = {}
        for ikey, key in cursor.iternext_nodup(keys=True, values=True):
            ikey = bytes(ikey)
            digest = ikey[:-len(empty)]
            if ikey[-len(empty):] != empty or digest in found:
                continue
            head_bytes = store.env.head_in(txn, bytes(key))
            try:
                head = codec.peek(head_bytes) if head_bytes is not None else None
            except CodecError:
                head = None
            if head is not None and head.namespace.digest() == digest:
                found[digest] = head.namespace
        return list(found.values())

    return store.transact(read)


def _spans_at(store, txn, cursor, want: tuple[bytes, dict, frozenset], tokens: np.ndarray, pos: int, digest: bytes,
              now: float, corrupt: list[tuple[bytes, bytes | None, str]]) -> list[SpanMatch]:
    """Live complete-coverage span groups after ``tokens[:pos]`` (``want``: namespace digest,
    ``to_dict()``, every (layer, head)); bad entries go to ``corrupt`` as ``(key, index key or
    None when the head does not parse, what is wrong)``."""
    ns_digest, ns_dict, full = want
    ikey = index_key(ns_digest, digest)
    keys = [bytes(k) for k in cursor.iternext_dup()] if cursor.set_key(ikey) else []
    groups: dict[tuple[int, bytes], list] = {}
    for key in keys:
        head_bytes = store.env.head_in(txn, key)
        if head_bytes is None:
            corrupt.append((key, ikey, "dangling index entry"))
            continue
        try:
            head = codec.peek(head_bytes)
        except CodecError as exc:
            corrupt.append((key, None, str(exc)))
            continue
        life = Lifecycle.unpack(txn.get(key, db=store.env.lifecycle))
        if head.namespace.to_dict() != ns_dict or head.token_start != pos or life.expires_at <= now:
            continue
        group = groups.setdefault((head.token_end, head.token_ids.tobytes()), [head, frozenset(), [], 0])
        group[1] = group[1] | _cells(head, ns_dict, full)
        group[2].append(key)
        group[3] += life.nbytes
    spans = []
    for head, covered, keys_, nbytes in groups.values():
        if covered == full:
            matched = common_prefix_len(head.token_ids, tokens[pos : head.token_end])
            if matched > 0:
                spans.append(SpanMatch(keys_, pos, head.token_end, matched, nbytes))
    return spans


def _cells(head, ns_dict: dict, full: frozenset) -> frozenset:
    """The (layer, KV head) pairs a fragment holds; ``full`` itself for a whole one (most are)."""
    if (head.layer_start, head.layer_end, head.layer_stride, head.head_start, head.head_end) == (
            0, ns_dict["n_layer"], 1, 0, ns_dict["n_head_kv"]):
        return full
    return frozenset((layer, h) for layer in head.layers for h in range(head.head_start, head.head_end))


def longest_chain(tokens: np.ndarray, spans_at: Callable[[int, bytes], list[SpanMatch]]) -> list[SpanMatch]:
    """The chain of spans reaching furthest into ``tokens`` (int32, shape ``(n,)``) from 0.

    ``spans_at(pos, digest)`` gives the span groups stored at ``pos`` after the prefix whose
    hash is ``digest`` (``schema.prefix_hasher`` over ``tokens[:pos]``); the search is
    :func:`prefix_walk`'s. Shared by the local walk and the remote tier's.
    """
    memo: dict[int, tuple[int, list[SpanMatch]]] = {}

    def best(pos: int, hasher) -> tuple[int, list[SpanMatch]]:
        if pos in memo:
            return memo[pos]
        found: tuple[int, list[SpanMatch]] = (pos, [])
        if pos < len(tokens):
            for span in spans_at(pos, hasher.digest()):
                if span.complete and span.token_end <= len(tokens):
                    nxt = hasher.copy()
                    nxt.update(token_bytes(tokens[pos : span.token_end]))
                    reach, chain = best(span.token_end, nxt)
                    option = (reach, [span] + chain)
                else:
                    option = (pos + span.matched, [span])
                if option[0] > found[0]:
                    found = option
        memo[pos] = found
        return found

    return best(0, prefix_hasher())[1]


def _full_cells(namespace: Namespace) -> tuple[bytes, dict, frozenset]:
    """``_spans_at``'s ``want`` for ``namespace``: its digest, ``to_dict()`` and every (layer, head)."""
    return (namespace.digest(), namespace.to_dict(),
            frozenset((layer, head) for layer in range(namespace.n_layer) for head in range(namespace.n_head_kv)))


def _remove_corrupt(store, corrupt: list[tuple[bytes, bytes | None, str]]) -> None:
    """Remove the dangling entries (unless read-only) and unparsable fragments ``_spans_at`` met."""
    for key, ikey, reason in corrupt:
        if ikey is not None and not store.readonly:
            # transact runs the function before it returns: binding the pair is only for clarity
            store.transact(lambda txn, ikey=ikey, key=key: txn.delete(ikey, key, db=store.env.by_prefix), write=True)
        elif ikey is None:
            store.drop_corrupt(key, f"its head does not parse: {reason}")


def local_spans(store, namespace: Namespace, tokens: Sequence[int] | np.ndarray,
                now: float | None = None) -> Callable[[int, bytes], list[SpanMatch]]:
    """The local ``spans_at(pos, digest)`` for :func:`longest_chain` in a walk that also asks
    another tier (``remote/walk.combined_walk``): the span groups :func:`prefix_walk` would
    find after ``tokens[:pos]``. One read transaction per call: a transaction over the whole
    walk would hold the environment's thread lock through the remote round trips."""
    now = store.clock() if now is None else now
    tokens = np.asarray(tokens, dtype=np.int32)
    want = _full_cells(namespace)

    def spans_at(pos: int, digest: bytes) -> list[SpanMatch]:
        corrupt: list[tuple[bytes, bytes | None, str]] = []
        spans = store.transact(lambda txn: _spans_at(store, txn, txn.cursor(db=store.env.by_prefix), want, tokens,
                                                     pos, digest, now, corrupt))
        _remove_corrupt(store, corrupt)
        return spans

    return spans_at


def prefix_walk(
    store, namespace: Namespace, tokens: Sequence[int] | np.ndarray, now: float | None = None
) -> PrefixMatch:
    """The longest run of live fragments of ``namespace`` matching ``tokens`` from position 0.

    At each position: the fragments stored after exactly this prefix, grouped by span, groups
    holding every layer and KV head kept; a fully matching group leads on to its end, a partly
    matching one ends a path. The path reaching furthest wins (a depth-first search: spans of
    other chunk sizes branch). One read transaction; corrupt or dangling entries are removed.
    """
    now = store.clock() if now is None else now
    tokens = np.asarray(tokens, dtype=np.int32)
    want = _full_cells(namespace)
    result = PrefixMatch()
    corrupt: list[tuple[bytes, bytes | None, str]] = []

    def read(txn) -> None:
        cursor = txn.cursor(db=store.env.by_prefix)
        result.spans[:] = longest_chain(
            tokens, lambda pos, digest: _spans_at(store, txn, cursor, want, tokens, pos, digest, now, corrupt))

    store.transact(read)
    _remove_corrupt(store, corrupt)
    return result
