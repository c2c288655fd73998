"""The store's lifecycle records and bulk maintenance, as a part of ``FragmentStore``.

:class:`LifecycleOps` holds the methods of :class:`~edgesync_store.core.backend.FragmentBackend`
that read or rewrite the ``lifecycle`` database (hits, expiry, the records of a merge or
dedup) and empty or recount the store. It is mixed into ``FragmentStore`` (``core/store.py``),
whose environment (``self.env``, :class:`~edgesync_store.core.lmdb_env.LmdbEnv`) and
``delete_in`` it uses; kept apart so that each module stays readable.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from edgesync_store.core import codec, companions
from edgesync_store.core.codec import FragmentHeader
from edgesync_store.core.lmdb_env import REUSE_TOKENS_PREFIX, U64, USED_BYTES_KEY, index_key
from edgesync_store.errors import CodecError
from edgesync_store.schema import KVFragment
from edgesync_store.ttl import Lifecycle


class LifecycleOps:
    """Lifecycle-record and maintenance methods of ``FragmentStore`` (documented on
    ``FragmentBackend``)."""

    def put_replacing(self, fragment: KVFragment, life: Lifecycle, remove: Sequence[bytes]) -> bool:
        """See :meth:`FragmentBackend.put_replacing`; ``life``'s sizes are set here. When the
        new key is already stored, only the removals happen."""
        key = fragment.key()
        blob = codec.encode(fragment, self.compression)
        env = self.env

        def write(txn) -> bool:
            if not all(env.has_blob(txn, k) for k in remove):
                return False
            if not env.has_blob(txn, key):
                self.put_blob_in(txn, key, index_key(fragment.namespace.digest(), fragment.prefix_hash), blob)
                self._add_used(txn, len(blob))
            life.nbytes, life.raw_nbytes = len(blob), fragment.raw_nbytes
            txn.put(key, life.pack(), db=env.lifecycle)
            for k in remove:
                if k != key:
                    companions.move_in(self, txn, k, key)
                    self.delete_in(txn, k)
            return True

        return self.transact(write, write=True)


    def absorb(self, keep: bytes, remove: Sequence[bytes], life: Lifecycle) -> bool:
        env = self.env

        def write(txn) -> bool:
            if not all(env.has_blob(txn, k) for k in [keep, *remove]):
                return False
            old = Lifecycle.unpack(txn.get(keep, db=env.lifecycle))
            life.nbytes, life.raw_nbytes = old.nbytes, old.raw_nbytes
            txn.put(keep, life.pack(), db=env.lifecycle)
            for k in remove:
                companions.move_in(self, txn, k, keep)
                self.delete_in(txn, k)
            return True

        return self.transact(write, write=True)


    def delete_expired(self, keys: Sequence[bytes], now: float | None = None) -> list[tuple[bytes, int]]:
        """See :meth:`FragmentBackend.delete_expired`: checked inside the write transaction (a
        hit in another process may have promoted one meanwhile)."""
        now = self.clock() if now is None else now
        env = self.env

        def write(txn) -> list[tuple[bytes, int]]:
            gone = []
            for key in keys:
                raw = txn.get(key, db=env.lifecycle)
                if raw is None and not env.has_blob(txn, key):
                    continue
                if not Lifecycle.unpack(raw).expired(now) or self.pins.is_pinned(key):
                    continue
                nbytes = self.delete_in(txn, key)
                if nbytes:
                    gone.append((key, nbytes))
                else:
                    txn.delete(key, db=env.lifecycle)  # a record without its fragment
            return gone

        return self.transact(write, write=True)


    def set_lifecycle(self, key: bytes, life: Lifecycle) -> bool:
        env = self.env

        def write(txn) -> bool:
            if not env.has_blob(txn, key):
                return False
            old = Lifecycle.unpack(txn.get(key, db=env.lifecycle))
            life.nbytes, life.raw_nbytes = old.nbytes, old.raw_nbytes
            txn.put(key, life.pack(), db=env.lifecycle)
            return True

        return self.transact(write, write=True)


    def record_hits(self, keys: Sequence[bytes], now: float | None = None, *,
                    reused: tuple[bytes, Sequence[int]] | None = None) -> None:
        now = self.clock() if now is None else now
        env = self.env
        hint = None if reused is None else np.asarray(reused[1], dtype="<i4").tobytes()

        def write(txn) -> None:
            if hint is not None:
                name = REUSE_TOKENS_PREFIX + reused[0]
                if txn.get(name, db=env.meta) != hint:
                    txn.put(name, hint, db=env.meta)
            for key in keys:
                if not env.has_blob(txn, key):
                    continue
                life = self.policy.on_hit(Lifecycle.unpack(txn.get(key, db=env.lifecycle)), now)
                txn.put(key, life.pack(), db=env.lifecycle)

        self.transact(write, write=True)


    def reuse_hint(self, namespace_digest: bytes) -> np.ndarray:
        """See :meth:`FragmentBackend.reuse_hint`: the ``reuse_tokens:`` record in ``meta``."""
        raw = self.transact(lambda txn: bytes(v) if (v := txn.get(REUSE_TOKENS_PREFIX + namespace_digest,
                                                                  db=self.env.meta)) is not None else b"")
        return np.frombuffer(raw[:len(raw) - len(raw) % 4], dtype="<i4").astype(np.int32)

    def release_mapped(self) -> None:
        """See :meth:`FragmentBackend.release_mapped`."""
        with self.env.lock:
            self.env.advice.release(self.env.map_size())


    def lifecycle(self, key: bytes) -> Lifecycle | None:
        def read(txn):
            if not self.env.has_blob(txn, key):
                return None
            return Lifecycle.unpack(txn.get(key, db=self.env.lifecycle))

        return self.transact(read)


    def lifecycles(self, keys: Sequence[bytes]) -> list[Lifecycle | None]:
        """See :meth:`FragmentBackend.lifecycles`: one read transaction."""
        def read(txn):
            env = self.env
            return [Lifecycle.unpack(txn.get(key, db=env.lifecycle)) if env.has_blob(txn, key) else None
                    for key in keys]

        return self.transact(read)


    def iterate(self) -> Iterator[tuple[bytes, FragmentHeader | None, Lifecycle, int]]:
        def read(txn):
            rows = []
            for key in txn.cursor(db=self.env.fragments).iternext(keys=True, values=False):
                key = bytes(key)
                life = Lifecycle.unpack(txn.get(key, db=self.env.lifecycle))
                try:
                    head = codec.peek(self.env.head_in(txn, key))
                except CodecError:
                    head = None
                rows.append((key, head, life, life.nbytes or len(txn.get(key, db=self.env.fragments))))
            return rows

        yield from self.transact(read)


    def iterate_lifecycle(self) -> list[tuple[bytes, Lifecycle]]:
        return self.transact(self.lifecycle_rows_in)


    def drop_all(self) -> int:
        """Empty the store in one write transaction: fragments, prefix index, lifecycle,
        donors and vectors (the format version and budget stay); return the fragment count.
        The pages are freed for reuse but keep their bytes until overwritten; ``clear.py``
        rewrites the file when it can."""
        env = self.env

        def write(txn) -> int:
            n = txn.stat(env.fragments)["entries"]
            for db in (env.fragments, env.heads, env.by_prefix, env.lifecycle):
                txn.drop(db, delete=False)
            companions.drop_in(self, txn)
            txn.put(USED_BYTES_KEY, U64.pack(0), db=env.meta)
            return n

        return self.transact(write, write=True)


    def recount_used(self) -> int:
        def write(txn) -> int:
            total = sum(len(v) for _, v in txn.cursor(db=self.env.fragments))
            txn.put(USED_BYTES_KEY, U64.pack(total), db=self.env.meta)
            return total

        return self.transact(write, write=True)
