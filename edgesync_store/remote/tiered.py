"""``TieredStore``: the storage seams over the local ``FragmentStore`` and a shared remote tier
(Redis 7 / Valkey, standalone or Cluster, laid out by ``tier.KeyLayout``). Reads fall through;
a fetched blob is verified, and written locally as the same bytes after the first token. Writes
go remote behind (remote expiry follows the lifetime; hits are summed over nodes). A remote fault
never fails a request; a corrupt or bad remote value is refused, counted and deleted. Maintenance
and donor records are local only; attributes not defined here are the local store's.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, TypeVar

import numpy as np

from edgesync_store.core import codec
from edgesync_store.core.backend import MaintenanceBackend
from edgesync_store.core.chain_read import ChainRead
from edgesync_store.core.store import FragmentStore, StoreStats
from edgesync_store.core.walk import PrefixMatch, local_spans
from edgesync_store.errors import CodecError, StoreError
from edgesync_store.remote import walk as remote_walk
from edgesync_store.remote.client import RemoteClient, RemoteUnavailable, checked_target
from edgesync_store.remote.queue import WriteBehind
from edgesync_store.remote.tier import Fetched, KeyLayout, head_of, parse_head
from edgesync_store.remote.url import RemoteURL
from edgesync_store.schema import MIN_SPAN, KVFragment, Namespace
from edgesync_store.ttl import LIFETIME_LONG, LIFETIME_SHORT, Lifecycle

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["DRAIN_S", "TieredStats", "TieredStore"]

DRAIN_S = 10.0
"""Seconds :meth:`TieredStore.close` waits for the queued remote writes."""


@dataclass
class TieredStats(StoreStats):
    """The local store's :class:`StoreStats` and the remote tier's counters (``remote``:
    ``RemoteCounters.to_dict()`` plus ``queued``, the write-behind jobs waiting)."""

    remote: dict = field(default_factory=dict)


class TieredStore(MaintenanceBackend):
    """The local store with a shared remote tier behind it (module docstring).

    Args:
        local: the local store (owned: closed with this object).
        client: the remote tier's connection (owned).
        prefix: the deployment's key prefix (``url.check_prefix``).
        queue_size: write-behind jobs waiting at most (one per fragment or hit batch).
        grid: the chunk size, tokens, whose positions the remote walk looks up in one batch.
        fetch_budget_ms: milliseconds one fragment's fetch may take in all; then it is abandoned.
    """

    def __init__(self, local: FragmentStore, client: RemoteClient, prefix: str = "edgesync", queue_size: int = 256,
                 grid: int = 128, fetch_budget_ms: float = 250.0) -> None:
        self.local = local
        self.client = client
        self.fetch_budget_s = fetch_budget_ms / 1000.0
        self.keys = KeyLayout(prefix, on_bad=self._bad_value)
        self.grid = grid
        self.queue = WriteBehind(queue_size, on_drop=lambda: client.count(queue_drops=1))
        self._fetched: dict[bytes, tuple[bytes, Lifecycle, KVFragment | None]] = {}
        self._refused: set[bytes] = set()
        self._lock = threading.Lock()
        self._closed = False
        log.info("remote tier %s (prefix %s%s) behind the local store %s", client.url.redacted, prefix,
                 ", cluster" if client.cluster else "", local.path)

    @classmethod
    def connect(cls, local: FragmentStore, url: RemoteURL | str, *, prefix: str = "edgesync", cluster: bool = False,
                timeout_ms: float = 20.0, write_timeout_ms: float = 2000.0, retry_s: float = 5.0,
                queue_size: int = 256, grid: int = 128, fetch_budget_ms: float = 250.0) -> "TieredStore":
        """A tiered store over ``local`` and the remote at ``url`` (``RemoteClient``'s arguments;
        connecting is lazy). ValueError: a bad URL, query argument (redacted) or key prefix."""
        url = checked_target(url, prefix, cluster)
        client = RemoteClient(url, cluster=cluster, timeout_ms=timeout_ms, write_timeout_ms=write_timeout_ms,
                              retry_s=retry_s)
        return cls(local, client, prefix=prefix, queue_size=queue_size, grid=grid, fetch_budget_ms=fetch_budget_ms)

    def __repr__(self) -> str:
        return f"TieredStore({self.local.path!s}, {self.client!r}, prefix={self.keys.prefix!r})"

    def __getattr__(self, name: str):
        if name == "local":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.local, name)

    # the seam's attributes are the local store's
    path = property(lambda self: self.local.path)
    readonly = property(lambda self: self.local.readonly)
    clock = property(lambda self: self.local.clock)
    policy = property(lambda self: self.local.policy)
    max_bytes = property(lambda self: self.local.max_bytes)
    pins = property(lambda self: self.local.pins)
    dropped_corrupt = property(lambda self: self.local.dropped_corrupt + self.client.counters.corrupt,
                               doc="Corrupt fragments refused by either tier.")

    # -- reads ----------------------------------------------------------------------------------

    def prefix_walk(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray,
                    now: float | None = None) -> PrefixMatch:
        """The local walk, or, when it leaves more than the prompt's last token uncovered, the
        walk over both tiers (``remote_walk.combined_walk``) when that reaches further. ``now``
        applies to the local groups only (the remote tier's expiry is Redis's own). A remote
        failure leaves the local walk; the local store's ``StoreError`` propagates."""
        local = self.local.prefix_walk(namespace, tokens, now)
        n = len(tokens)
        if n < MIN_SPAN or local.matched_tokens >= n - 1:
            return local
        try:
            both, remote_spans = remote_walk.combined_walk(
                self._lookup("fast", namespace), local_spans(self.local, namespace, tokens, now), local, namespace,
                tokens, self.grid)
        except RemoteUnavailable:
            return local
        self.client.count(walks=1)
        if both.matched_tokens <= local.matched_tokens:
            return local
        self.client.count(walk_gains=1, walk_splits=int(0 < remote_spans < len(both.spans)))
        return both

    def get(self, key: bytes, *, copy: bool = False) -> KVFragment | None:
        """The local fragment, else one fetched from the remote (verified; module docstring)."""
        frag = self.local.get(key, copy=copy)
        if frag is not None:
            return frag
        with self._lock:
            pending = self._fetched.get(key)
        if pending is not None:
            return self._decoded(key, *pending)
        if key in self._refused:
            return None
        return self._fetch(key)

    @contextmanager
    def reading(self, keys: Sequence[bytes], *, defer_checks: bool = False) -> Iterator[ChainRead]:
        """The local store's in-place read; the keys it lacks are fetched from the remote first
        (verified, arrays of their own), so that no network wait happens inside the local read
        transaction."""
        keys = [bytes(k) for k in keys]
        fetched = {key: self.get(key) for key, life in zip(keys, self.local.lifecycles(keys)) if life is None}
        with self.local.reading(keys, defer_checks=defer_checks) as local:
            for i, key in enumerate(keys):
                if key in fetched:
                    local[i] = (fetched[key], False)
            yield local

    serves_in_place = property(lambda self: self.local.serves_in_place)

    def reuse_hint(self, namespace_digest: bytes) -> np.ndarray:
        """The local store's (the remote tier keeps none)."""
        return self.local.reuse_hint(namespace_digest)

    def release_mapped(self) -> None:
        """The local store's."""
        self.local.release_mapped()

    def lifecycles(self, keys: Sequence[bytes]) -> list[Lifecycle | None]:
        """The local records (one read transaction); for a key the local store lacks, the
        record of the remote fragment, fetched and verified now and held for :meth:`get`
        (None: the remote has no usable one). Raises StoreIOError: the local store failed."""
        return [life if life is not None else self._remote_lifecycle(key)
                for key, life in zip(keys, self.local.lifecycles(keys))]

    def _flush_fetched(self) -> None:
        """Write the fetched fragments locally, as fetched (not to a read-only store)."""
        with self._lock:
            items, self._fetched = [(k, b, life) for k, (b, life, _f) in self._fetched.items()], {}
        if not items or self.local.readonly:
            return
        try:
            self.local.put_blobs(items)
        except (StoreError, PermissionError) as exc:
            log.warning("could not keep %d fragments fetched from the remote tier locally: %s", len(items), exc)

    def covers_span(self, namespace: Namespace, prefix: bytes, token_ids: Sequence[int] | np.ndarray,
                    token_start: int, now: float | None = None) -> bool:
        """The local tier's coverage (fetched fragments written first): what the request path
        stores back is decided locally, and reaches the remote behind."""
        self._flush_fetched()
        return self.local.covers_span(namespace, prefix, token_ids, token_start, now)

    def keys_along(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Local and remote fragments along ``tokens`` (remote: live or not; none when the
        remote is unavailable)."""
        found = self.local.keys_along(namespace, tokens)
        try:
            remote = remote_walk.keys_along(self._lookup("slow", namespace, live_only=False), namespace, tokens)
        except RemoteUnavailable:
            remote = []
        return found + [k for k in remote if k not in set(found)]

    def namespaces(self) -> list[Namespace]:
        """Namespaces of either tier (the remote's as its writers recorded them)."""
        found = {ns.digest(): ns for ns in self.local.namespaces()}
        for ns in self._remote("fast", self.keys.namespaces, "namespaces", []):
            found.setdefault(ns.digest(), ns)
        return list(found.values())

    # -- talking to the remote tier ------------------------------------------------------------

    def _remote(self, which: str, op: Callable[[object], T], what: str, default: T) -> T:
        """``op(client)`` on the remote, or ``default`` when it is unavailable (counted, logged)."""
        try:
            return self.client.call(which, op, what)
        except RemoteUnavailable:
            return default

    def _bad_value(self, name: str, why: str) -> None:
        """``KeyLayout.on_bad``: count and log an unusable remote value, delete its key behind."""
        self.client.count(bad_values=1)
        self.client.note("bad value", "remote tier %s: key %s %s; deleting it", self.client.url.redacted, name, why)
        self.queue.submit(lambda: self._remote("slow", lambda c: c.unlink(name), "bad value removal", None))

    def _lookup(self, which: str, namespace: Namespace, live_only: bool = True) -> remote_walk.Lookup:
        """The remote walk's lookup in ``namespace`` (bad or orphan index fields dropped behind)."""
        digest = namespace.digest()

        def lookup(prefixes: Sequence[bytes]) -> list[list[remote_walk.Candidate]]:
            ikeys = [self.keys.index_key(digest, p) for p in prefixes]
            entries = self.client.call(which, lambda c: self.keys.index_entries(c, ikeys), "index lookup")
            found, stale = [], []
            for ikey, fields in zip(ikeys, entries):
                row = []
                for key, value in fields.items():
                    key, head = bytes(key), parse_head(value)
                    if head is None or len(key) != 32:
                        self.client.count(corrupt=1)
                        stale.append((ikey, key))
                    elif key not in self._refused:
                        row.append((key, head, head.blob_nbytes))
                found.append(row)
            if live_only and any(found):  # no entry at all: no existence round trip
                flat = [(i, c) for i, row in enumerate(found) for c in row]
                alive = self.client.call(which, lambda c: self.keys.alive(c, [k for _, (k, _h, _n) in flat]),
                                         "index lookup")
                stale += [(ikeys[i], cand[0]) for (i, cand), ok in zip(flat, alive) if not ok]
                dead = {cand[0] for (_, cand), ok in zip(flat, alive) if not ok}
                found = [[c for c in row if c[0] not in dead] for row in found]
            if stale:
                self.queue.submit(lambda: self._remote("slow", lambda c: self.keys.drop_index_fields(c, stale),
                                                       "index cleanup", None))
            return found

        return lookup

    def _decoded(self, key: bytes, blob: bytes, life: Lifecycle, frag: KVFragment | None) -> KVFragment | None:
        """A fetched fragment not yet written locally: the held decode once, a new one after."""
        if frag is not None:
            with self._lock:
                if key in self._fetched:
                    self._fetched[key] = (blob, life, None)
            return frag
        try:
            frag = codec.decode(blob)
        except CodecError:
            return None
        frag.hit_count, frag.last_hit_at, frag.expires_at = life.hit_count, life.last_hit_at, life.expires_at
        return frag

    def _fetch(self, key: bytes) -> KVFragment | None:
        """Fetch and verify one remote fragment, kept to be written locally (None: absent,
        unavailable, refused, or over ``fetch_budget_s`` seconds)."""
        deadline = time.monotonic() + self.fetch_budget_s  # the whole fetch's, not one read's
        got: Fetched | None = self._remote("fast", lambda c: self.keys.fetch(c, key, deadline), "fetch", None)
        if got is None:  # unavailable, or too slow for the budget: counted by the client
            return None
        if got.blob is None:
            self.client.count(misses=1)
            return None
        blob, hits, pttl = got.blob, got.hits, got.pttl_ms
        try:
            frag = codec.decode(blob)
            if frag.key() != key:
                raise CodecError("stored under a key that its content does not hash to")
        except CodecError as exc:
            self._refuse(key, str(exc))
            return None
        now, policy = self.clock(), self.policy
        promoted = hits >= policy.promote_hits or pttl == -1 or pttl > policy.ttl_seconds * 1000
        # -2: gone between GET and PTTL, or a reply that did not parse: the short lifetime
        left = policy.long_ttl_seconds if pttl == -1 else pttl / 1000.0 if pttl >= 0 else policy.ttl_seconds
        life = Lifecycle(hits, now if hits else 0.0, now + left, frag.created_at,
                         LIFETIME_LONG if promoted else LIFETIME_SHORT, len(blob), frag.raw_nbytes)
        frag.hit_count, frag.last_hit_at, frag.expires_at = life.hit_count, life.last_hit_at, life.expires_at
        self.client.count(hits=1, bytes_fetched=len(blob))
        with self._lock:  # a read-only local store drops it at the flush instead of writing it
            self._fetched[key] = (bytes(blob), life, frag)
        return frag

    def _remote_lifecycle(self, key: bytes) -> Lifecycle | None:
        """The record of the remote fragment ``key``, fetched now if not yet (None: no usable one)."""
        with self._lock:
            pending = self._fetched.get(key)
        if pending is None:
            if key in self._refused or self._fetch(key) is None:
                return None
            with self._lock:
                pending = self._fetched.get(key)
        return None if pending is None else pending[1]

    def _refuse(self, key: bytes, reason: str) -> None:
        """Count, log and delete a corrupt remote blob; this process never asks for it again."""
        self.client.count(corrupt=1)
        self._refused.add(key)
        log.warning("refusing remote fragment %s: %s; deleting it from the remote tier", key.hex()[:16], reason)
        if self._remote("fast", lambda c: self.keys.delete(c, [key]), "delete", 0):
            self.client.count(deletes=1)

    # -- served by the local tier (presence and records also see fetched fragments) --------------

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._fetched:
                return True
        return self.local.contains(key)

    def is_live(self, key: bytes, now: float | None = None) -> bool:
        self._flush_fetched()
        return self.local.is_live(key, now)

    def lifecycle(self, key: bytes) -> Lifecycle | None:
        life = self.local.lifecycle(key)
        if life is None:
            with self._lock:
                pending = self._fetched.get(key)
            life = pending[1] if pending is not None else None
        return life

    def set_lifecycle(self, key: bytes, life: Lifecycle) -> bool:
        self._flush_fetched()
        return self.local.set_lifecycle(key, life)

    def iterate(self) -> Iterator:
        return self.local.iterate()

    def iterate_lifecycle(self) -> list[tuple[bytes, Lifecycle]]:
        return self.local.iterate_lifecycle()

    def delete_expired(self, keys: Sequence[bytes], now: float | None = None) -> list[tuple[bytes, int]]:
        return self.local.delete_expired(keys, now)

    def put_replacing(self, fragment: KVFragment, life: Lifecycle, remove: Sequence[bytes]) -> bool:
        return self.local.put_replacing(fragment, life, remove)

    def absorb(self, keep: bytes, remove: Sequence[bytes], life: Lifecycle) -> bool:
        return self.local.absorb(keep, remove, life)

    def used_bytes(self) -> int:
        return self.local.used_bytes()

    def recount_used(self) -> int:
        return self.local.recount_used()

    def transact(self, fn, write: bool = False):
        return self.local.transact(fn, write=write)

    def named_db(self, name: bytes, create: bool = False, dupsort: bool = False, txn=None):
        return self.local.named_db(name, create=create, dupsort=dupsort, txn=txn)

    def contains_in(self, txn, key: bytes) -> bool:
        return self.local.contains_in(txn, key)

    def delete_in(self, txn, key: bytes) -> int:
        return self.local.delete_in(txn, key)

    def used_in(self, txn) -> int:
        return self.local.used_in(txn)

    def lifecycle_rows_in(self, txn) -> list[tuple[bytes, Lifecycle]]:
        return self.local.lifecycle_rows_in(txn)

    # -- writes ----------------------------------------------------------------------------------

    def put_many(self, fragments: Sequence[KVFragment], now: float | None = None, *,
                 donor: tuple[bytes, bytes] | None = None) -> int:
        """Local at once (with ``donor``); each fragment then goes to the remote in the
        background (skipped there when the remote already holds it)."""
        self._flush_fetched()
        written = self.local.put_many(fragments, now, donor=donor)
        for key in dict.fromkeys(f.key() for f in fragments):
            self.queue.submit(lambda key=key: self._push(key))
        return written

    def put_donor(self, key: bytes, value: bytes) -> bool:
        """Donor records are local only."""
        return self.local.put_donor(key, value)

    def _push(self, key: bytes) -> None:
        """Write-behind job: the local fragment ``key`` to the remote (index entry only if held)."""
        try:
            blob, life = self.local.get_blob(key), self.local.lifecycle(key)
        except StoreError as exc:
            log.debug("remote write of %s: local read failed: %s", key.hex()[:16], exc)
            return
        now = self.clock()
        if blob is None or life is None or life.expired(now):
            return  # evicted, merged or expired meanwhile
        long_ttl = self.policy.long_ttl_seconds
        ttl = long_ttl if life.lifetime != LIFETIME_SHORT else min(life.expires_at - now, long_ttl)
        try:
            head_bytes = head_of(blob)
            head = codec.peek(head_bytes)
        except CodecError:
            return  # the local read path refuses and removes it

        try:  # the blob first, its index entry only once it is stored (KeyLayout.put)
            if self.client.call("slow", lambda c: self.keys.put(c, key, blob, head, head_bytes, ttl, long_ttl),
                                "write"):
                self.client.count(puts=1, bytes_written=len(blob))
        except RemoteUnavailable:
            self.client.count(write_skips=1)

    def record_hits(self, keys: Sequence[bytes], now: float | None = None, *,
                    reused: tuple[bytes, Sequence[int]] | None = None) -> None:
        """Local hits at once (fetched fragments written first), remote hit counts behind."""
        self._flush_fetched()
        self.local.record_hits(keys, now, reused=reused)
        keys = list(keys)
        policy = self.policy

        def add() -> None:
            counted = self._remote("slow", lambda c: self.keys.add_hits(c, keys, policy.ttl_seconds,
                                                                        policy.long_ttl_seconds,
                                                                        policy.promote_hits), "hit count", 0)
            self.client.count(hits_recorded=counted)

        self.queue.submit(add)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete from both tiers (remote: synchronous, best effort, logged when unavailable)."""
        keys = [bytes(k) for k in keys]
        with self._lock:
            for k in keys:
                self._fetched.pop(k, None)
        removed = self.local.delete_many(keys)
        gone = self._remote("slow", lambda c: self.keys.delete(c, keys), "delete", None)
        if gone is None and keys:
            log.warning("remote tier unavailable: %d fragments removed locally only", len(keys))
        else:
            self.client.count(deletes=gone or 0)
        return removed

    def forget_tokens(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> int:
        """Delete the prompt's fragments from both tiers (remote blobs, counters and index
        fields); returns the distinct fragments removed from either."""
        local_keys = self.local.keys_along(namespace, tokens)
        self.local.delete_many(local_keys)
        removed = set(local_keys)
        digest = namespace.digest()
        entries: list[tuple[str, bytes]] = []

        def collect(prefixes: Sequence[bytes]) -> list[list[remote_walk.Candidate]]:
            rows = self._lookup("slow", namespace, live_only=False)(prefixes)
            for p, row in zip(prefixes, rows):
                entries.extend((self.keys.index_key(digest, p), key) for key, _h, _n in row)
            return rows

        try:
            remote = remote_walk.keys_along(collect, namespace, tokens)
            mine = [e for e in entries if e[1] in set(remote)]
            gone = self.client.call("slow", lambda c: self.keys.delete(c, remote), "forget")
            self.client.call("slow", lambda c: self.keys.drop_index_fields(c, mine), "forget")
            self.client.count(deletes=gone)
            removed |= set(remote)
        except RemoteUnavailable:
            log.warning("remote tier unavailable: the prompt's remote fragments were not removed")
        with self._lock:
            for key in removed:
                self._fetched.pop(key, None)
        return len(removed)

    # -- counters and closing ------------------------------------------------------------------

    def remote_stats(self) -> dict:
        """The remote tier's counters (``RemoteCounters.to_dict()``), ``queued`` (write-behind
        jobs waiting) and ``circuit_open``."""
        with self.client.counters_lock:
            out = self.client.counters.to_dict()
        return {**out, "queued": len(self.queue), "circuit_open": self.client.breaker.is_open}

    def stats(self) -> TieredStats:
        """The local store's stats with :meth:`remote_stats` as ``remote``."""
        self._flush_fetched()
        base = self.local.stats()
        return TieredStats(**base.to_dict(), remote=self.remote_stats())

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Write fetched fragments locally, wait up to ``timeout_s`` seconds for the queued
        remote writes; True when none is left."""

        self._flush_fetched()
        return self.queue.drain(timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Run the queued remote writes (up to :data:`DRAIN_S` seconds), then close the remote
        client and the local store (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._flush_fetched()
        left = self.queue.close(DRAIN_S)
        if left:
            self.client.count(queue_drops=left)
        self.client.close()
        self.local.close()
