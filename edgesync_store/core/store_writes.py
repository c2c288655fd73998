"""The store's fragment writes, as a part of ``FragmentStore``: new fragments (``put_many``) and
blobs that are already encoded and verified (``put_blobs``, for a fragment fetched from the
remote tier: its exact bytes are stored, no second encoding). Every blob goes in with its head
(``heads``) and its ``by_prefix`` entry, in the same transaction (:meth:`WriteOps.put_blob_in`).

:class:`WriteOps` is mixed into ``FragmentStore`` (``core/store.py``), whose environment
(``self.env``), ``delete_in``, ``used_in`` and budget it uses. Both writes share one
transaction body: a live twin is left alone and an expired one, or one whose stored head is
corrupt, replaced; the size budget
evicts first (``lifecycle/eviction.py``) and a fragment that still does not fit is skipped.
"""

from __future__ import annotations

import logging
from typing import Sequence

from edgesync_store.core import codec
from edgesync_store.core.lmdb_env import U64, USED_BYTES_KEY, index_key
from edgesync_store.errors import CodecError
from edgesync_store.lifecycle import eviction
from edgesync_store.schema import KVFragment
from edgesync_store.ttl import Lifecycle

log = logging.getLogger(__name__)

Encoded = tuple[bytes, bytes, bytes, Lifecycle, str]
"""(store key, by_prefix index key, blob, lifecycle record, what to call it in a log line)."""


class WriteOps:
    """Fragment writes of ``FragmentStore`` (documented on ``FragmentBackend.put_many``)."""

    def put_many(self, fragments: Sequence[KVFragment], now: float | None = None, *, also=None) -> int:
        """See :meth:`FragmentBackend.put_many` (``also`` gets the ``lmdb.Transaction``): eviction
        frees down to ``eviction.LOW_WATER`` (90%) of the budget. Encoding (compression) happens
        before the transaction so the writer lock is held only for the copy into LMDB."""
        encoded = []
        for f in fragments:
            blob = codec.encode(f, self.compression)
            life = Lifecycle(f.hit_count, f.last_hit_at, f.expires_at, f.created_at, nbytes=len(blob),
                             raw_nbytes=f.raw_nbytes)
            encoded.append((f.key(), index_key(f.namespace.digest(), f.prefix_hash), blob, life,
                            f"fragment [{f.token_start}, {f.token_end})"))
        return self._write_encoded(encoded, now, also)

    def put_blobs(self, items: Sequence[tuple[bytes, bytes, Lifecycle]], now: float | None = None) -> int:
        """Store blobs as they are: ``(store key, codec blob, lifecycle record)`` each, the blob
        already decoded and verified by the caller (``codec.decode`` and its key); the record's
        sizes are set here. The rules of :meth:`put_many`; returns how many were written.

        Raises:
            CodecError: a blob whose head does not parse (nothing written).
            PermissionError: read-only. StoreIOError: LMDB failed (nothing written).
        """
        encoded = []
        for key, blob, life in items:
            head = codec.peek(blob)
            life = Lifecycle(life.hit_count, life.last_hit_at, life.expires_at, life.created_at, life.lifetime,
                             nbytes=len(blob), raw_nbytes=head.raw_nbytes)
            encoded.append((bytes(key), index_key(head.namespace.digest(), head.prefix_hash), bytes(blob), life,
                            f"fragment [{head.token_start}, {head.token_end})"))
        return self._write_encoded(encoded, now)

    def put_blob_in(self, txn, key: bytes, ikey: bytes, blob: bytes) -> None:
        """Write ``blob`` under ``key``, its head (``codec.head_of``) in ``heads`` and its
        ``by_prefix`` entry ``ikey``, in ``txn`` (the lifecycle record and ``used_bytes`` are
        the caller's).

        Raises:
            CodecError: the blob's head does not parse (nothing written).
        """
        head = codec.head_of(blob)
        env = self.env
        txn.put(key, blob, db=env.fragments)
        txn.put(key, head, db=env.heads)
        txn.put(ikey, key, db=env.by_prefix, dupdata=True)

    def sound_head_in(self, txn, key: bytes) -> bool:
        """True when the stored head of fragment ``key`` parses (``codec.peek``, memoized);
        else False, logged and counted in ``dropped_corrupt``: a walk stops at the first
        corrupt head it meets, so a store-back that left the twins after it alone would leave
        them for one request each to find."""
        try:
            codec.peek(self.env.head_in(txn, key))
            return True
        except CodecError as exc:
            self.dropped_corrupt += 1
            log.warning("replacing fragment %s: its stored head is corrupt (%s)", key.hex()[:16], exc)
            return False

    def _write_encoded(self, encoded: Sequence[Encoded], now: float | None, also=None) -> int:
        now = self.clock() if now is None else now
        env = self.env

        def write(txn) -> int:
            todo, seen = [], set()
            for item in encoded:
                key = item[0]
                if key in seen:
                    continue
                seen.add(key)
                if env.has_blob(txn, key):
                    live = not Lifecycle.unpack(txn.get(key, db=env.lifecycle)).expired(now)
                    if live and self.sound_head_in(txn, key):
                        continue
                    self.delete_in(txn, key)
                todo.append(item)
            used, incoming = self.used_in(txn), sum(len(t[2]) for t in todo)
            if used + incoming > self.max_bytes:
                target = int(self.max_bytes * eviction.LOW_WATER)
                evicted = eviction.evict_in(self, txn, used + incoming - target, now, protect={t[0] for t in todo})
                used -= sum(nbytes for _, nbytes in evicted)
            added = 0
            for key, ikey, blob, life, what in todo:
                if used + len(blob) > self.max_bytes:
                    log.warning("%s (%d bytes) does not fit the size budget of %d bytes; not stored", what,
                                len(blob), self.max_bytes)
                    continue
                self.put_blob_in(txn, key, ikey, blob)
                txn.put(key, life.pack(), db=env.lifecycle)
                used += len(blob)
                added += 1
            txn.put(USED_BYTES_KEY, U64.pack(used), db=env.meta)
            if also is not None:
                also(txn)
            return added

        return self.transact(write, write=True)
