"""The store's fragment reads, as a part of ``FragmentStore``: a fragment decoded into arrays of
its own (``get``), its blob (``get_blob``), and a chain's fragments read in place for one
injection (``reading``).

:class:`ReadOps` is mixed into ``FragmentStore`` (``core/store.py``), whose environment
(``self.env``), ``max_raw_bytes``, ``compression`` and ``drop_corrupt`` it uses. Every read
verifies what it returns (``codec.decode``: both checksums, the header, the content hash) and
that the fragment hashes to the key it was stored under; a corrupt one is refused, logged and
removed after the read transaction.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator, Sequence

from edgesync_store.core import codec
from edgesync_store.core.chain_read import ChainRead
from edgesync_store.errors import CodecError
from edgesync_store.schema import KVFragment
from edgesync_store.ttl import Lifecycle


class ReadOps:
    """Fragment reads of ``FragmentStore`` (documented on ``FragmentBackend``)."""

    @property
    def serves_in_place(self) -> bool:
        """True when fragments this store writes are read in place (:meth:`reading`, no copy
        of the tensors): its blobs are uncompressed (``compression="none"``)."""
        return self.compression == "none"

    def contains(self, key: bytes) -> bool:
        return self.transact(lambda txn: self.contains_in(txn, key))

    def is_live(self, key: bytes, now: float | None = None) -> bool:
        now = self.clock() if now is None else now

        def read(txn) -> bool:
            if not self.env.has_blob(txn, key):
                return False
            return Lifecycle.unpack(txn.get(key, db=self.env.lifecycle)).expires_at > now

        return self.transact(read)

    def get_blob(self, key: bytes) -> bytes | None:
        def read(txn) -> bytes | None:
            value = txn.get(key, db=self.env.fragments)
            return bytes(value) if value is not None else None

        return self.transact(read)

    def _verified(self, key: bytes, blob, life: Lifecycle, views: bool,
                  corrupt: list, check_payload: bool = True) -> KVFragment | None:
        """``blob`` decoded and checked against ``key`` (its payload checksum too unless not
        ``check_payload``), with the counters of ``life``; K and V are views of ``blob`` when
        ``views`` and the payload is uncompressed. None when corrupt (then ``(key, reason)`` is
        appended to ``corrupt``)."""
        try:
            frag = codec.decode(blob, max_raw_bytes=self.max_raw_bytes, copy=not views, check_payload=check_payload)
        except CodecError as exc:
            corrupt.append((key, str(exc)))
            return None
        if frag.key() != key:
            corrupt.append((key, "stored under a key that its content does not hash to"))
            return None
        frag.hit_count, frag.last_hit_at, frag.expires_at = life.hit_count, life.last_hit_at, life.expires_at
        return frag

    def _read_in(self, txn, key: bytes, in_place: bool, corrupt: list,
                 deferred: list | None = None) -> tuple[KVFragment | None, bool]:
        """The verified fragment ``key`` read in ``txn``, and whether its K and V are views of
        the map (``in_place`` and an uncompressed blob); (None, False) when absent or corrupt.
        With ``deferred`` (a list) the payload checksum of a fragment read in place is left to
        the caller: ``(key, payload view, expected xxh3)`` is appended to it."""
        value = txn.get(key, db=self.env.fragments)
        if value is None:
            return None, False
        life = Lifecycle.unpack(txn.get(key, db=self.env.lifecycle))
        try:
            head = codec.peek(value)
            views = in_place and head.compression == "none"
            later = views and deferred is not None and head.version >= 2
            if later:
                deferred.append((key, *codec.payload_check(value)))
        except CodecError as exc:
            corrupt.append((key, str(exc)))
            return None, False
        frag = self._verified(key, value, life, views, corrupt, check_payload=not later)
        if frag is None and later:
            deferred.pop()
        return frag, views and frag is not None

    def _drop_all_corrupt(self, corrupt: list) -> None:
        for key, reason in corrupt:
            self.drop_corrupt(key, reason)

    def get(self, key: bytes, *, copy: bool = False) -> KVFragment | None:
        """See :meth:`FragmentBackend.get`: decoded into arrays of its own inside one read
        transaction (blob and lifecycle record together); with ``copy`` the blob is copied out
        and decoded after the transaction. A blob that fails ``codec.decode`` or whose
        recomputed key differs from ``key`` is corrupt."""
        corrupt: list = []
        if copy:
            def read(txn):
                value = txn.get(key, db=self.env.fragments)
                if value is None:
                    return None, None
                return bytes(value), Lifecycle.unpack(txn.get(key, db=self.env.lifecycle))

            blob, life = self.transact(read)
            frag = None if blob is None else self._verified(key, blob, life, False, corrupt)
        else:
            frag = self.transact(lambda txn: self._read_in(txn, key, False, corrupt)[0])
        self._drop_all_corrupt(corrupt)
        return frag

    @contextmanager
    def reading(self, keys: Sequence[bytes], *, defer_checks: bool = False) -> Iterator[ChainRead]:
        """See :meth:`FragmentBackend.reading`: one read transaction held for the ``with`` block
        (this process's other threads wait on the environment's lock meanwhile, so inject and
        leave); an uncompressed blob's K and V are read-only views of LMDB's map, not copied.
        With ``defer_checks`` their payload checksums (xxh3) run in a thread of their own while
        the block uses the views (an injection's copies overlap them on a second core):
        ``confirm()`` waits for them; the block's end waits for them too, so no check ever reads
        a view after the transaction."""
        corrupt: list = []
        deferred: list | None = [] if defer_checks else None
        try:
            with self.env.reader(whole_values=True) as txn:
                got = _Checked(self._read_in(txn, bytes(key), True, corrupt, deferred) for key in keys)
                if deferred:
                    got.start(deferred, corrupt)
                try:
                    yield got
                finally:
                    got.confirm()
        finally:
            self._drop_all_corrupt(corrupt)


class _Checked(ChainRead):
    """A :class:`ChainRead` whose in-place payload checksums run in :data:`CHECKS`' thread."""

    _future: Future | None = None
    _failed: list[bytes] | None = None
    _corrupt: list | None = None

    def start(self, deferred: list, corrupt: list) -> None:
        """Check ``(key, payload view, expected xxh3)`` of each of ``deferred`` in the background;
        a mismatch goes to ``corrupt`` (by :meth:`confirm`)."""
        self._corrupt = corrupt
        self._future = _checks().submit(_failing, deferred)

    def confirm(self) -> list[bytes]:
        """Wait for the checks; the keys that failed (also reported as corrupt)."""
        if self._failed is None:
            self._failed = self._future.result() if self._future is not None else []
            if self._corrupt is not None:
                self._corrupt.extend((key, "payload checksum: xxh3 mismatch (corrupt tensors)") for key in self._failed)
        return list(self._failed)


def _failing(deferred: list) -> list[bytes]:
    """Keys of ``(key, payload, expected)`` whose payload's xxh3 differs (xxhash releases the GIL)."""
    return [key for key, payload, expected in deferred if codec.checksum(payload) != expected]


_CHECKS: ThreadPoolExecutor | None = None
_CHECKS_LOCK = threading.Lock()


def _checks() -> ThreadPoolExecutor:
    """The one thread of this process that runs deferred payload checksums (made on first use)."""
    global _CHECKS
    with _CHECKS_LOCK:
        if _CHECKS is None:
            _CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgesync-checksum")
        return _CHECKS
