"""The methods of ``TieredStore`` that are the local store's alone: lifecycle records, the
expiry sweep's and the compactor's operations, sizes and maintenance transactions.

The remote tier keeps its own expiry (Redis ``EXPIRE``) and its size bound (Redis
``maxmemory``), so none of these reach it; :class:`LocalTierOps` is mixed into
:class:`~edgesync_store.remote.tiered.TieredStore`, whose ``local`` store (a
``FragmentStore``) and ``_flush_fetched`` it uses.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from edgesync_store.schema import KVFragment
from edgesync_store.ttl import Lifecycle


class LocalTierOps:
    """``FragmentBackend`` methods served by the local tier (documented there); the blob and
    presence queries also see fragments fetched from the remote and not yet written locally."""

    def get_blob(self, key: bytes) -> bytes | None:
        blob = self.local.get_blob(key)
        if blob is None:
            with self._lock:
                pending = self._fetched.get(key)
            blob = pending[0] if pending is not None else None
        return blob

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

    def contains_in(self, txn, key: bytes) -> bool:
        return self.local.contains_in(txn, key)

    def delete_in(self, txn, key: bytes) -> int:
        return self.local.delete_in(txn, key)

    def used_in(self, txn) -> int:
        return self.local.used_in(txn)

    def lifecycle_rows_in(self, txn) -> list[tuple[bytes, Lifecycle]]:
        return self.local.lifecycle_rows_in(txn)

