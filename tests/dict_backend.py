"""DictBackend: a ``FragmentBackend`` in plain dicts, the request seam's proof and its example.

It implements every abstract member of ``edgesync_store.core.backend.FragmentBackend`` and
nothing of ``MaintenanceBackend`` (no transactions, no named databases, no size budget), and
``tests/test_dict_backend.py`` serves the default mode through ``EdgeSync`` with it. A third
backend starts here: blobs in the store's own format (``codec``: every read verified), an index
``(namespace digest, prefix hash) -> keys``, and ``walk.longest_chain`` for the prefix walk.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Sequence

import numpy as np

from edgesync_store.core import codec
from edgesync_store.core.backend import ChainRead, FragmentBackend, PinTableLike
from edgesync_store.core.store import StoreStats
from edgesync_store.core.walk import PrefixMatch, SpanMatch, longest_chain
from edgesync_store.schema import MIN_SPAN, KVFragment, Namespace, common_prefix_len, prefix_hasher, token_bytes
from edgesync_store.ttl import Lifecycle, TTLPolicy


class DictPins(PinTableLike):
    """Pins of this process (a backend shared by processes needs a shared table)."""

    def __init__(self) -> None:
        self.counts: Counter[bytes] = Counter()

    @contextmanager
    def pinned(self, keys):
        keys = list(keys)
        self.counts.update(keys)
        try:
            yield
        finally:
            self.counts.subtract(keys)

    def is_pinned(self, key: bytes) -> bool:
        return self.counts[key] > 0


def cells(head) -> set[tuple[int, int]]:
    """The (layer, KV head) pairs a fragment's header says it holds."""
    return {(layer, h) for layer in head.layers for h in range(head.head_start, head.head_end)}


class DictBackend(FragmentBackend):
    """Fragments as ``codec`` blobs in this process's memory; ``clock``: Unix seconds."""

    def __init__(self, clock=time.time, policy: TTLPolicy | None = None) -> None:
        self.path, self.readonly, self.clock, self.pins = "dict:", False, clock, DictPins()
        self.policy = policy or TTLPolicy()
        self.blobs: dict[bytes, bytes] = {}
        self.lives: dict[bytes, Lifecycle] = {}
        self.index: dict[tuple[bytes, bytes], list[bytes]] = {}
        self.donors: dict[bytes, bytes] = {}
        self.hints: dict[bytes, np.ndarray] = {}
        self.lock = threading.RLock()

    def heads(self, ns: Namespace, prefix: bytes, live_at: float | None = None):
        """(key, header, lifecycle) of the fragments stored right after the prefix hash ``prefix``."""
        with self.lock:
            keys = [k for k in self.index.get((ns.digest(), bytes(prefix)), ()) if k in self.blobs]
            rows = [(k, codec.peek(self.blobs[k]), self.lives[k]) for k in keys]
        return [r for r in rows if live_at is None or not r[2].expired(live_at)]

    def get(self, key: bytes, *, copy: bool = False) -> KVFragment | None:
        with self.lock:
            blob, life = self.blobs.get(key), self.lives.get(key)
        if blob is None:
            return None
        frag = codec.decode(blob)
        frag.hit_count, frag.last_hit_at, frag.expires_at = life.hit_count, life.last_hit_at, life.expires_at
        return frag

    @contextmanager
    def reading(self, keys: Sequence[bytes], *, defer_checks: bool = False):
        yield ChainRead((self.get(bytes(k)), False) for k in keys)

    serves_in_place = False

    def put_many(self, fragments: Sequence[KVFragment], now: float | None = None, *,
                 donor: tuple[bytes, bytes] | None = None) -> int:
        now, written = self.clock() if now is None else now, 0
        with self.lock:
            for f in fragments:
                key = f.key()
                if key in self.blobs and not self.lives[key].expired(now):
                    continue
                self.blobs[key] = blob = codec.encode(f, "none")
                self.lives[key] = Lifecycle(f.hit_count, f.last_hit_at, f.expires_at, f.created_at,
                                            nbytes=len(blob), raw_nbytes=f.raw_nbytes)
                entry = self.index.setdefault((f.namespace.digest(), f.prefix_hash), [])
                entry += [] if key in entry else [key]
                written += 1
            if donor is not None:
                self.put_donor(*donor)
        return written

    def put_donor(self, key: bytes, value: bytes) -> bool:
        with self.lock:
            if key not in self.blobs or key in self.donors:
                return False
            self.donors[key] = value
            return True

    def is_live(self, key: bytes, now: float | None = None) -> bool:
        life = self.lives.get(key)
        return life is not None and not life.expired(self.clock() if now is None else now)

    def prefix_walk(self, namespace: Namespace, tokens, now: float | None = None) -> PrefixMatch:
        now, tokens = self.clock() if now is None else now, np.asarray(tokens, dtype=np.int32)
        full = {(layer, h) for layer in range(namespace.n_layer) for h in range(namespace.n_head_kv)}

        def spans_at(pos: int, digest: bytes) -> list[SpanMatch]:
            groups: dict[tuple[int, bytes], list] = {}
            for key, head, life in self.heads(namespace, digest, now):
                if head.token_start == pos:
                    group = groups.setdefault((head.token_end, head.token_ids.tobytes()), [head, set(), [], 0])
                    group[1] |= cells(head)
                    group[2].append(key)
                    group[3] += life.nbytes
            return [SpanMatch(keys, pos, head.token_end, matched, nbytes)
                    for head, held, keys, nbytes in groups.values()
                    if held == full and (matched := common_prefix_len(head.token_ids, tokens[pos:head.token_end]))]

        return PrefixMatch(longest_chain(tokens, spans_at))

    def covers_span(self, namespace: Namespace, prefix: bytes, token_ids, token_start: int,
                    now: float | None = None) -> bool:
        ids = np.asarray(token_ids, dtype=np.int32)
        held = [cells(head) for _, head, _ in self.heads(namespace, prefix, self.clock() if now is None else now)
                if head.token_start == token_start and np.array_equal(head.token_ids, ids)]
        return len(set().union(*held)) == namespace.n_layer * namespace.n_head_kv

    def keys_along(self, namespace: Namespace, tokens) -> list[bytes]:
        tokens, hasher, found = np.asarray(tokens, dtype=np.int32), prefix_hasher(), []
        for pos in range(len(tokens)):
            for key, head, _ in self.heads(namespace, hasher.digest()):
                need = 1 if pos else min(MIN_SPAN, head.span)
                if head.token_start == pos and common_prefix_len(head.token_ids, tokens[pos:pos + head.span]) >= need:
                    found.append(key)
            hasher.update(token_bytes(tokens[pos:pos + 1]))
        return found

    def namespaces(self) -> list[Namespace]:
        with self.lock:
            heads = [codec.peek(blob) for blob in self.blobs.values()]
        return list({h.namespace.digest(): h.namespace for h in heads if h.token_start == 0}.values())

    def forget_tokens(self, namespace: Namespace, tokens) -> int:
        keys = self.keys_along(namespace, tokens)
        with self.lock:
            for key in keys:  # index entries of a gone key are skipped by heads()
                del self.blobs[key], self.lives[key]
                self.donors.pop(key, None)
        return len(keys)

    def lifecycle(self, key: bytes) -> Lifecycle | None:
        return self.lifecycles([key])[0]

    def lifecycles(self, keys: Sequence[bytes]) -> list[Lifecycle | None]:
        with self.lock:
            return [copy.copy(self.lives.get(k)) for k in keys]

    def record_hits(self, keys: Sequence[bytes], now: float | None = None, *,
                    reused: tuple[bytes, Sequence[int]] | None = None) -> None:
        now = self.clock() if now is None else now
        with self.lock:
            for key in keys:
                if key in self.lives:
                    self.policy.on_hit(self.lives[key], now)
            if reused is not None:
                self.hints[reused[0]] = np.asarray(reused[1], dtype=np.int32)

    def reuse_hint(self, namespace_digest: bytes) -> np.ndarray:
        return self.hints.get(namespace_digest, np.zeros(0, dtype=np.int32))

    def release_mapped(self) -> None:
        """Nothing is mapped."""

    def stats(self) -> StoreStats:
        with self.lock:
            lives = list(self.lives.values())
        return StoreStats(len(lives), sum(x.nbytes for x in lives), sum(x.raw_nbytes for x in lives), 0, 0, 0)

    def close(self) -> None:
        """Nothing to release."""
