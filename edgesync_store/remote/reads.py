"""The read side of ``TieredStore`` that talks to the remote tier: the remote walk's index
lookup, fetching and verifying one fragment, refusing a corrupt blob and removing an unusable
value.

:class:`RemoteReads` is mixed into :class:`~edgesync_store.remote.tiered.TieredStore`, whose
``client`` (``RemoteClient``), ``keys`` (``KeyLayout``), ``queue`` (``WriteBehind``),
``local`` store, ``fetch_budget_s``, ``_fetched``, ``_refused`` and ``_lock`` it uses. Nothing a remote server
returns fails a request: a corrupt or foreign blob is refused (``corrupt``), a value of the
wrong type or form (``tier.KeyLayout.on_bad``) is skipped, counted (``bad_values``), logged and
deleted in the background.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence, TypeVar

from edgesync_store.core import codec
from edgesync_store.errors import CodecError
from edgesync_store.remote import walk as remote_walk
from edgesync_store.remote.client import RemoteUnavailable
from edgesync_store.remote.tier import Fetched, parse_head
from edgesync_store.schema import KVFragment, Namespace
from edgesync_store.ttl import LIFETIME_LONG, LIFETIME_SHORT, Lifecycle

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["RemoteReads"]


class RemoteReads:
    """``TieredStore``'s remote reads (module docstring)."""

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
        """The remote walk's lookup in ``namespace``: index hashes, heads parsed (a field that
        does not parse, or whose blob is gone, is dropped from the index in the background)."""
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
        """A fetched fragment not yet written locally: its decoded copy the first time it is
        asked for (held since the fetch), a new decode after that."""
        if frag is not None:
            with self._lock:
                if key in self._fetched:
                    self._fetched[key] = (blob, life, None)
            return frag
        try:
            frag = codec.decode(blob, max_raw_bytes=self.local.max_raw_bytes)
        except CodecError:
            return None
        frag.hit_count, frag.last_hit_at, frag.expires_at = life.hit_count, life.last_hit_at, life.expires_at
        return frag

    def _fetch(self, key: bytes) -> KVFragment | None:
        """Fetch, verify and return one remote fragment (None: absent, unavailable, refused, or
        not read whole within ``fetch_budget_s`` seconds, so the request prefills its tokens);
        it is kept to be written locally after the first token."""
        deadline = time.monotonic() + self.fetch_budget_s  # the whole fetch's, not one read's
        got: Fetched | None = self._remote("fast", lambda c: self.keys.fetch(c, key, deadline), "fetch", None)
        if got is None:  # unavailable, or too slow for the budget: counted by the client
            return None
        if got.blob is None:
            self.client.count(misses=1)
            return None
        blob, hits, pttl = got.blob, got.hits, got.pttl_ms
        try:
            frag = codec.decode(blob, max_raw_bytes=self.local.max_raw_bytes)
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
        """The record of the remote fragment under ``key`` as fetched (already, or now: the
        request reads it next, so fetching it here costs nothing more), None when the remote
        has no usable one (absent, unavailable, refused, over the fetch budget)."""
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
