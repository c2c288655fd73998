"""FragmentStore: KV fragments in LMDB, shared by the processes of one device.

One LMDB environment (a directory created mode 0700: it holds users' prompts) with four
named databases:

* ``fragments``: store key (32 bytes, ``schema.store_key``) -> blob (``codec``);
* ``by_prefix`` (dupsort): namespace digest + prefix hash (64 bytes) -> store keys of the
  fragments that start right after that prefix; the prefix walk's index;
* ``lifecycle``: store key -> the fragment's tier, hits, creation, last hit, expiry and sizes
  (``ttl.Lifecycle``, 45 bytes); kept apart from the blob so that a hit, the expiry sweep and
  eviction never read or rewrite tensors;
* ``meta``: store-wide facts: ``format_version`` (see ``migrations/``), ``used_bytes`` (sum of
  the stored blobs, ``<Q``; what the size budget counts), ``max_bytes`` (the budget, ``<Q``).

Lifetimes follow ``ttl.TTLPolicy`` on the store's clock (injectable); the size budget
(``max_bytes``) is enforced when writing (``eviction.py``: expired first, then the short-term
tier least recently used, then the long-term tier least recently used, never a fragment a
request has pinned). Cross-process coordination beyond LMDB's own is in ``locks.py``.

LMDB serialises writers across processes with its lock file and gives readers snapshots, so
several processes may read and write one store at once. A write that finds the map full grows
it (doubling) and retries; a process that sees another one's larger map (MapResizedError)
adopts it. Only committed transactions survive a kill; a commit is durable (LMDB's default
sync).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb
import numpy as np

import migrations

from edgesync_store.core import codec

from edgesync_store.lifecycle import eviction

from edgesync_store.core import walk
from edgesync_store.core.codec import CodecError, FragmentHeader
from edgesync_store.core.locks import COMPACT_LOCK_NAME, OPEN_LOCK_NAME, PINS_LOCK_NAME, OpenLock, PinTable, StoreBusyError
from edgesync_store.schema import KVFragment, Namespace
from edgesync_store.ttl import Clock, Lifecycle, TTLPolicy
from edgesync_store.core.walk import PrefixMatch, SpanMatch
from edgesync_store.errors import StoreFormatError, StoreOpenError, StoreUnavailableError

log = logging.getLogger("edgesync.store")

STORE_FORMAT_VERSION = migrations.CURRENT_VERSION
"""On-disk layout version recorded in the ``meta`` database (``migrations/``)."""
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
"""Default size budget: 1 GiB of stored fragments (compressed blobs), about 500 cached
350-token SmolLM2-135M prompts at the 2 MB each that the benchmark measured."""
DEFAULT_MAP_SIZE = 256 * 1024 * 1024
"""Initial LMDB map size in bytes; doubled whenever a write finds it full (sparse on Linux)."""
MAX_MAP_SIZE = 1 << 40

_U64 = struct.Struct("<Q")
_OWN_FILES = ("lock.mdb", OPEN_LOCK_NAME, PINS_LOCK_NAME, COMPACT_LOCK_NAME)
"""Files of ours that may sit in a store directory without ``data.mdb`` (besides ``semantic.*``)."""
T = TypeVar("T")

__all__ = ["FragmentStore", "Lifecycle", "PrefixMatch", "SpanMatch", "StoreBusyError", "StoreFormatError",
           "StoreOpenError", "StoreUnavailableError", "StoreStats", "DEFAULT_MAX_BYTES", "STORE_FORMAT_VERSION"]


@dataclass
class StoreStats:
    """Counts and sizes (bytes) of a store."""

    fragments: int
    compressed_bytes: int
    raw_bytes: int
    disk_bytes: int
    map_size: int
    dropped_corrupt: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class FragmentStore:
    """KV fragments in LMDB, keyed by ``schema.store_key``.

    Args:
        path: store directory; created (mode 0700) when missing.
        map_size: initial LMDB map size in bytes (grows on demand).
        max_raw_bytes: decompressed-size cap passed to ``codec.decode``.
        readonly: open without writing (no growth, no migration, no removal of corrupt
            entries).
        clock: the time source, Unix seconds (default ``time.time``); tests inject
            ``ttl.ManualClock``.
        policy: tier lifetimes and promotion (default ``TTLPolicy()``: 30 minutes, 5 hits,
            7 days).
        max_bytes: size budget in bytes of stored blobs; None keeps the budget recorded in the
            store (the last one an application set) or :data:`DEFAULT_MAX_BYTES`. A value given
            here is recorded for ``python -m edgesync_engines.app.compact`` to follow.
        open_timeout_s: seconds to wait while another process reclaims or clears the store.

    A new directory is created with mode 0700 (it will hold users' prompts); an existing
    directory's mode is left alone. Opening an older store runs its migrations
    (``migrations/``).

    Raises:
        StoreFormatError: the store was written by a newer format version.
        StoreOpenError: the path is a file, a non-empty directory without a store, cannot be
            created, or does not open as LMDB (read-only: holds no store).
        StoreBusyError: another process held the store exclusively for ``open_timeout_s``.
        ValueError: ``max_bytes`` < 1.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        map_size: int = DEFAULT_MAP_SIZE,
        max_raw_bytes: int = codec.DEFAULT_MAX_RAW_BYTES,
        readonly: bool = False,
        *,
        clock: Clock | None = None,
        policy: TTLPolicy | None = None,
        max_bytes: int | None = None,
        open_timeout_s: float = 120.0,
    ) -> None:
        self.path = Path(path).expanduser()
        self.max_raw_bytes = max_raw_bytes
        self.readonly = readonly
        self.dropped_corrupt = 0
        self.clock: Clock = clock or time.time
        self.policy = policy or TTLPolicy()
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes: must be a positive number of bytes, got {max_bytes!r}")
        if not str(path).strip():
            raise StoreOpenError("store path: is empty")
        try:
            str(self.path).encode("utf-8")
        except UnicodeEncodeError:
            raise StoreOpenError(f"store path {self.path!r}: is not valid UTF-8 (LMDB needs it)") from None
        if self.path.exists() and not self.path.is_dir():
            raise StoreOpenError(f"store path {self.path}: exists and is not a directory")
        if self.path.is_dir() and not (self.path / "data.mdb").exists():
            others = [p.name for p in self.path.iterdir()
                      if p.name not in _OWN_FILES and not p.name.startswith(("semantic.", ".reclaim"))]
            if others:
                shown = ", ".join(sorted(others)[:3]) + (", ..." if len(others) > 3 else "")
                raise StoreOpenError(
                    f"store path {self.path}: holds other files ({shown}) and no EdgeSync store"
                    + ("" if readonly else "; choose an empty or new directory")
                )
        if readonly and not (self.path / "data.mdb").exists():
            raise StoreOpenError(f"no EdgeSync store at {self.path}")
        if not readonly and not self.path.exists():
            try:
                self.path.mkdir(mode=0o700, parents=True)  # a new store is private: it holds prompts
                os.chmod(self.path, 0o700)  # mkdir's mode is filtered by the umask
            except OSError as exc:
                raise StoreUnavailableError(f"cannot create the store directory {self.path}: {exc}") from None
        self._lock = threading.RLock()
        self._named: dict[bytes, object] = {}
        self._map_size = map_size
        self._writable_dir = os.access(self.path, os.W_OK)
        self._open_lock: OpenLock | None = None
        if self._writable_dir:
            try:
                self._open_lock = OpenLock(self.path, open_timeout_s)
            except OSError as exc:
                raise StoreUnavailableError(f"cannot lock the store at {self.path}: {exc}") from None
        try:
            self._env = self._open_env()
            self._check_is_edgesync_lmdb()
            self.format_version = migrations.migrate(self)
            self._open_dbs()
        except BaseException:
            self._release_locks()
            raise
        self.pins = PinTable(self.path)
        self.max_bytes = self._settle_budget(max_bytes)

    def _open_env(self) -> lmdb.Environment:
        try:
            return lmdb.open(
                str(self.path),
                map_size=self._map_size,
                subdir=True,
                max_dbs=8,
                mode=0o600,
                readonly=self.readonly,
                # a read-only look at a store we cannot write (another user's, read-only media)
                lock=not self.readonly or self._writable_dir,
                readahead=False,
                meminit=False,
                max_readers=256,
            )
        except lmdb.Error as exc:
            raise StoreUnavailableError(f"cannot open the store at {self.path}: {exc}") from None

    def _open_dbs(self) -> None:
        """Handles of the four core databases (created by migration 1)."""
        self._named.clear()
        self._fragments = self.named_db(b"fragments")
        self._by_prefix = self.named_db(b"by_prefix", dupsort=True)
        self._lifecycle = self.named_db(b"lifecycle")
        self._meta = self.named_db(b"meta")
        for name in (b"donors", b"emb_vectors", b"emb_meta"):  # cached now, if they exist: see named_db
            self.named_db(name)
        if None in (self._fragments, self._by_prefix, self._lifecycle, self._meta):
            raise StoreOpenError(f"store {self.path}: its databases are missing (format {self.format_version})")

    def named_db(self, name: bytes, create: bool = False, dupsort: bool = False, txn: lmdb.Transaction | None = None):
        """The handle of the named database ``name`` in this store's environment, or None when
        it does not exist and ``create`` is False or the store is read-only.

        Handles are cached until a reclaim reopens the environment (callers ask again rather
        than keep one). Inside a transaction pass it as ``txn``: opening a database without one
        starts a write transaction, which would deadlock inside another.
        """
        with self._lock:
            handle = self._named.get(name)
            if handle is not None:
                return handle
            for _ in range(64):
                try:
                    handle = self._env.open_db(name, txn=txn, dupsort=dupsort, create=create and not self.readonly)
                    break
                except lmdb.MapResizedError:  # another process grew the map since lmdb.open
                    if txn is not None:
                        raise
                    self._env.set_mapsize(0)
                except (lmdb.NotFoundError, lmdb.ReadonlyError):
                    return None
            else:
                raise lmdb.MapResizedError(f"store {self.path}: cannot open database {name!r}")
            if txn is None:
                self._named[name] = handle
            return handle

    def _settle_budget(self, max_bytes: int | None) -> int:
        recorded = self._txn(lambda txn: txn.get(b"max_bytes", db=self._meta))
        recorded = _U64.unpack(bytes(recorded))[0] if recorded is not None and len(recorded) == 8 else None
        if max_bytes is None:
            return recorded or DEFAULT_MAX_BYTES
        if max_bytes != recorded and not self.readonly:
            self._txn(lambda txn: txn.put(b"max_bytes", _U64.pack(max_bytes), db=self._meta), write=True)
        return max_bytes

    def _release_locks(self) -> None:
        if self._open_lock is not None:
            self._open_lock.close()
            self._open_lock = None

    def _check_is_edgesync_lmdb(self) -> None:
        """Refuse a truncated data file (LMDB would die of SIGBUS reading past its end) and an
        LMDB environment written by something else (we would write our databases into it)."""
        info, psize = self._env.info(), self._env.stat()["psize"]
        data = self.path / "data.mdb"
        needed = (info["last_pgno"] + 1) * psize
        if data.exists() and data.stat().st_size < needed:
            self._env.close()
            raise StoreOpenError(
                f"store {self.path}: data.mdb is truncated ({data.stat().st_size} of {needed} bytes); "
                "delete the directory (it is a cache) or restore it"
            )
        # through _txn: another process may grow the map between lmdb.open and this read
        names = self._txn(lambda txn: {bytes(k) for k, _ in txn.cursor()})
        # named databases are created in one transaction (migration 1), but an older EdgeSync
        # created them one transaction each: any one of them marks an EdgeSync store
        if names and not names & {b"fragments", b"by_prefix", b"lifecycle", b"meta"}:
            self._env.close()
            raise StoreOpenError(f"store path {self.path}: holds an LMDB database that is not an EdgeSync store")

    def _reopen_env(self) -> None:
        """Close and reopen the LMDB environment (after ``reclaim`` replaced ``data.mdb``).
        The caller holds ``self._lock``."""
        self._env.close()
        self._env = self._open_env()
        self._open_dbs()

    # -- transactions -------------------------------------------------------------------

    def _txn(self, fn: Callable[[lmdb.Transaction], T], write: bool = False) -> T:
        """Run ``fn`` in a transaction, growing or re-reading the map size as LMDB asks."""
        if write and self.readonly:
            raise PermissionError(f"store {self.path} is open read-only")
        for _ in range(64):
            with self._lock:
                try:
                    with self._env.begin(write=write, buffers=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    new_size = min(self._env.info()["map_size"] * 2, MAX_MAP_SIZE)
                    log.info("LMDB map full: growing %s to %d bytes", self.path, new_size)
                    self._env.set_mapsize(new_size)
                except lmdb.MapResizedError:
                    log.debug("another process grew the map of %s", self.path)
                    self._env.set_mapsize(0)
        raise lmdb.MapFullError(f"store {self.path}: cannot grow the map beyond {MAX_MAP_SIZE} bytes")

    def _used(self, txn: lmdb.Transaction) -> int:
        value = txn.get(b"used_bytes", db=self._meta)
        return _U64.unpack(bytes(value))[0] if value is not None and len(value) == 8 else 0

    def _add_used(self, txn: lmdb.Transaction, delta: int) -> None:
        txn.put(b"used_bytes", _U64.pack(max(0, self._used(txn) + delta)), db=self._meta)

    # -- writes ---------------------------------------------------------------------------

    def put(self, fragment: KVFragment) -> bool:
        """Store a fragment; return False (and write nothing) when its key is already there."""
        return self.put_many([fragment]) == 1

    def put_many(self, fragments: Sequence[KVFragment], now: float | None = None) -> int:
        """Store fragments in one write transaction; return how many were written.

        A fragment whose key is stored and live is left alone; one whose stored twin has
        expired (``expires_at <= now``) replaces it with fresh lifecycle counters. When the
        new blobs would take the store past ``max_bytes``, fragments are evicted first
        (``eviction.py``), down to 90% of the budget; a fragment that still does not fit is not
        written (logged). Encoding (compression) happens before the transaction so the writer
        lock is held only for the copy into LMDB.
        """
        now = self.clock() if now is None else now
        encoded = [(f.key(), f.namespace.digest() + f.prefix_hash, codec.encode(f), f) for f in fragments]

        def write(txn: lmdb.Transaction) -> int:
            todo, seen = [], set()
            for key, index_key, blob, frag in encoded:
                if key in seen:
                    continue
                seen.add(key)
                if txn.get(key, db=self._fragments) is not None:
                    if not Lifecycle.unpack(txn.get(key, db=self._lifecycle)).expired(now):
                        continue
                    self._delete_in(txn, key)
                todo.append((key, index_key, blob, frag))
            used, incoming = self._used(txn), sum(len(blob) for _, _, blob, _ in todo)
            if used + incoming > self.max_bytes:
                target = int(self.max_bytes * eviction.LOW_WATER)
                evicted = eviction.evict_in(self, txn, used + incoming - target, now, protect={t[0] for t in todo})
                used -= sum(nbytes for _, nbytes in evicted)
            added = 0
            for key, index_key, blob, frag in todo:
                if used + len(blob) > self.max_bytes:
                    log.warning("fragment [%d, %d) (%d bytes) does not fit the size budget of %d bytes; not stored",
                                frag.token_start, frag.token_end, len(blob), self.max_bytes)
                    continue
                txn.put(key, blob, db=self._fragments)
                txn.put(index_key, key, db=self._by_prefix, dupdata=True)
                life = Lifecycle(frag.hit_count, frag.last_hit_at, frag.expires_at, frag.created_at,
                                 nbytes=len(blob), raw_nbytes=frag.raw_nbytes)
                txn.put(key, life.pack(), db=self._lifecycle)
                used += len(blob)
                added += 1
            txn.put(b"used_bytes", _U64.pack(used), db=self._meta)
            return added

        return self._txn(write, write=True)

    def put_replacing(self, fragment: KVFragment, life: Lifecycle, remove: Sequence[bytes]) -> bool:
        """In one write transaction, store ``fragment`` with the lifecycle ``life`` (its
        ``nbytes``/``raw_nbytes`` are set here) and delete the fragments ``remove`` (keys other
        than the new one): a merge or dedup either happens whole or not at all. When the new
        key is already stored, only the removals happen. Returns False, writing nothing, when
        one of ``remove`` is gone meanwhile (another process changed the store)."""
        key = fragment.key()
        blob = codec.encode(fragment)

        def write(txn: lmdb.Transaction) -> bool:
            if any(txn.get(k, db=self._fragments) is None for k in remove):
                return False
            if txn.get(key, db=self._fragments) is None:
                txn.put(key, blob, db=self._fragments)
                txn.put(fragment.namespace.digest() + fragment.prefix_hash, key, db=self._by_prefix, dupdata=True)
                self._add_used(txn, len(blob))
            life.nbytes, life.raw_nbytes = len(blob), fragment.raw_nbytes
            txn.put(key, life.pack(), db=self._lifecycle)
            for k in remove:
                if k != key:
                    self._move_semantic(txn, k, key)
                    self._delete_in(txn, k)
            return True

        return self._txn(write, write=True)

    def _move_semantic(self, txn: lmdb.Transaction, old: bytes, new: bytes) -> None:
        """Re-key the donor record and vector of ``old`` to ``new`` (a merge replaced it)."""
        from edgesync_store.semantic import vectors

        donors_db = self.named_db(b"donors", txn=txn)
        if donors_db is not None:
            record = txn.get(old, db=donors_db)
            if record is not None and txn.get(new, db=donors_db) is None:
                txn.put(new, bytes(record), db=donors_db)
        vectors.move_in(self, txn, old, new)

    def absorb(self, keep: bytes, remove: Sequence[bytes], life: Lifecycle) -> bool:
        """In one write transaction, give ``keep`` the lifecycle ``life`` (its sizes kept),
        move the donor records and vectors of ``remove`` to ``keep`` and delete ``remove``: a
        dedup happens whole or not at all. False, writing nothing, when any of them is gone
        meanwhile."""

        def write(txn: lmdb.Transaction) -> bool:
            if any(txn.get(k, db=self._fragments) is None for k in [keep, *remove]):
                return False
            old = Lifecycle.unpack(txn.get(keep, db=self._lifecycle))
            life.nbytes, life.raw_nbytes = old.nbytes, old.raw_nbytes
            txn.put(keep, life.pack(), db=self._lifecycle)
            for k in remove:
                self._move_semantic(txn, k, keep)
                self._delete_in(txn, k)
            return True

        return self._txn(write, write=True)

    def delete_expired(self, keys: Sequence[bytes], now: float | None = None) -> list[tuple[bytes, int]]:
        """Delete those of ``keys`` that are still expired at ``now`` inside the write
        transaction (a hit in another process may have promoted one meanwhile) and not pinned;
        return the ``(key, blob bytes)`` deleted."""
        now = self.clock() if now is None else now

        def write(txn: lmdb.Transaction) -> list[tuple[bytes, int]]:
            gone = []
            for key in keys:
                raw = txn.get(key, db=self._lifecycle)
                if raw is None and txn.get(key, db=self._fragments) is None:
                    continue
                if not Lifecycle.unpack(raw).expired(now) or self.pins.is_pinned(key):
                    continue
                nbytes = self._delete_in(txn, key)
                if nbytes:
                    gone.append((key, nbytes))
                else:
                    txn.delete(key, db=self._lifecycle)  # a record without its fragment
            return gone

        return self._txn(write, write=True)

    def set_lifecycle(self, key: bytes, life: Lifecycle) -> bool:
        """Overwrite a stored fragment's lifecycle record (sizes kept); False when absent."""

        def write(txn: lmdb.Transaction) -> bool:
            if txn.get(key, db=self._fragments) is None:
                return False
            old = Lifecycle.unpack(txn.get(key, db=self._lifecycle))
            life.nbytes, life.raw_nbytes = old.nbytes, old.raw_nbytes
            txn.put(key, life.pack(), db=self._lifecycle)
            return True

        return self._txn(write, write=True)

    def delete(self, key: bytes) -> bool:
        """Remove a fragment, its index entries and its donor record and vector, if any;
        return False when it was not there."""
        return self.delete_many([key]) == 1

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """:meth:`delete` for several fragments in one write transaction; return how many
        were there."""
        return self._txn(lambda txn: sum(self._delete_in(txn, bytes(k)) > 0 for k in keys), write=True)

    def _delete_in(self, txn: lmdb.Transaction, key: bytes) -> int:
        """Delete one fragment with its index entry, lifecycle, donor record and vector inside
        ``txn``; return the bytes of its blob (0: it was not there)."""
        from edgesync_store.semantic import vectors

        blob = txn.get(key, db=self._fragments)
        if blob is None:
            return 0
        nbytes = len(blob)
        try:
            head = codec.peek(blob)
            txn.delete(head.namespace.digest() + head.prefix_hash, key, db=self._by_prefix)
        except CodecError:
            pass  # a dangling by_prefix entry is dropped by the next walk that meets it
        txn.delete(key, db=self._fragments)
        txn.delete(key, db=self._lifecycle)
        donors_db = self.named_db(b"donors", txn=txn)
        if donors_db is not None:
            txn.delete(key, db=donors_db)
        vectors.delete_in(self, txn, key)
        self._add_used(txn, -nbytes)
        return nbytes

    def record_hits(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Add one hit to each fragment at ``now`` (default: the store's clock): hit_count + 1,
        last_hit_at = now, promotion to the long-term tier by ``policy``."""
        now = self.clock() if now is None else now

        def write(txn: lmdb.Transaction) -> None:
            for key in keys:
                if txn.get(key, db=self._fragments) is None:
                    continue
                life = self.policy.on_hit(Lifecycle.unpack(txn.get(key, db=self._lifecycle)), now)
                txn.put(key, life.pack(), db=self._lifecycle)

        self._txn(write, write=True)

    def _drop_corrupt(self, key: bytes, reason: str) -> None:
        self.dropped_corrupt += 1
        log.warning("refusing corrupt fragment %s: %s; removing it", key.hex()[:16], reason)
        if not self.readonly:
            self._txn(lambda txn: self._delete_in(txn, key), write=True)

    # -- reads ----------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True when a fragment is stored under ``key`` (expired or not)."""
        return self._txn(lambda txn: txn.get(key, db=self._fragments) is not None)

    def is_live(self, key: bytes, now: float | None = None) -> bool:
        """True when a fragment is stored under ``key`` and has not expired at ``now`` (default:
        the store's clock)."""
        now = self.clock() if now is None else now

        def read(txn: lmdb.Transaction) -> bool:
            if txn.get(key, db=self._fragments) is None:
                return False
            return Lifecycle.unpack(txn.get(key, db=self._lifecycle)).expires_at > now

        return self._txn(read)

    def get_blob(self, key: bytes) -> bytes | None:
        """The raw blob stored under ``key`` (a copy), or None."""

        def read(txn: lmdb.Transaction) -> bytes | None:
            value = txn.get(key, db=self._fragments)
            return bytes(value) if value is not None else None

        return self._txn(read)

    def get(self, key: bytes) -> KVFragment | None:
        """Decode and verify the fragment under ``key``.

        Returns None when it is absent, or when it is corrupt: a blob that fails
        ``codec.decode`` or whose recomputed key differs from ``key`` is logged, removed from
        the store and counted in ``stats().dropped_corrupt``.
        """

        def read(txn: lmdb.Transaction):
            value = txn.get(key, db=self._fragments)
            if value is None:
                return None, None
            try:
                frag = codec.decode(value, max_raw_bytes=self.max_raw_bytes)
            except CodecError as exc:
                return None, str(exc)
            return frag, Lifecycle.unpack(txn.get(key, db=self._lifecycle))

        frag, extra = self._txn(read)
        if frag is None:
            if extra is not None:
                self._drop_corrupt(key, extra)
            return None
        if frag.key() != key:
            self._drop_corrupt(key, "stored under a key that its content does not hash to")
            return None
        frag.hit_count, frag.last_hit_at, frag.expires_at = extra.hit_count, extra.last_hit_at, extra.expires_at
        return frag

    def lifecycle(self, key: bytes) -> Lifecycle | None:
        """The hit count, last hit and expiry of a fragment, or None when absent."""

        def read(txn: lmdb.Transaction):
            if txn.get(key, db=self._fragments) is None:
                return None
            return Lifecycle.unpack(txn.get(key, db=self._lifecycle))

        return self._txn(read)

    def iterate(self) -> Iterator[tuple[bytes, FragmentHeader | None, Lifecycle, int]]:
        """Yield ``(key, header or None if corrupt, lifecycle, compressed bytes)`` per fragment.

        Reads headers only (no decompression). A snapshot: one read transaction per call.
        """

        def read(txn: lmdb.Transaction):
            rows = []
            for key, value in txn.cursor(db=self._fragments):
                try:
                    head = codec.peek(value)
                except CodecError:
                    head = None
                rows.append((bytes(key), head, Lifecycle.unpack(txn.get(key, db=self._lifecycle)), len(value)))
            return rows

        yield from self._txn(read)

    def iterate_lifecycle(self) -> list[tuple[bytes, Lifecycle]]:
        """Every fragment's ``(key, lifecycle)`` from the ``lifecycle`` database alone (no blob
        is read): what expiry and eviction scan. A snapshot (one read transaction)."""
        return self._txn(lambda txn: [(bytes(k), Lifecycle.unpack(v)) for k, v in txn.cursor(db=self._lifecycle)])

    def used_bytes(self) -> int:
        """Bytes of the stored blobs (compressed fragments): what ``max_bytes`` bounds."""
        return self._txn(self._used)

    def recount_used(self) -> int:
        """Recompute ``used_bytes`` from the blobs themselves (the compactor's check against
        drift); return it."""

        def write(txn: lmdb.Transaction) -> int:
            total = sum(len(v) for _, v in txn.cursor(db=self._fragments))
            txn.put(b"used_bytes", _U64.pack(total), db=self._meta)
            return total

        return self._txn(write, write=True)

    def covers_span(self, namespace: Namespace, prefix: bytes, token_ids: Sequence[int] | np.ndarray,
                    token_start: int, now: float | None = None) -> bool:
        """See :func:`walk.covers_span`."""
        return walk.covers_span(self, namespace, prefix, token_ids, token_start, now)

    def keys_along(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """See :func:`walk.keys_along`."""
        return walk.keys_along(self, namespace, tokens)

    def prefix_walk(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray, now: float | None = None) -> PrefixMatch:
        """See :func:`walk.prefix_walk`: the longest run of stored fragments matching
        ``tokens`` from position 0."""
        return walk.prefix_walk(self, namespace, tokens, now)

    def namespaces(self) -> list[Namespace]:
        """See :func:`walk.stored_namespaces`: the namespaces whose chains start in this store."""
        return walk.stored_namespaces(self)

    def forget_tokens(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> int:
        """Delete every fragment :meth:`keys_along` finds for ``tokens`` (with donor records
        and vectors) in one write transaction; return how many were deleted."""
        return self.delete_many(self.keys_along(namespace, tokens))

    def drop_all(self) -> int:
        """Empty the store in one write transaction: fragments, prefix index, lifecycle,
        donors and vectors (the format version and budget stay); return the fragment count.
        The pages are freed for reuse but keep their bytes until overwritten; ``clear.py``
        rewrites the file when it can."""
        from edgesync_store.semantic import vectors

        def write(txn: lmdb.Transaction) -> int:
            n = txn.stat(self._fragments)["entries"]
            for db in (self._fragments, self._by_prefix, self._lifecycle):
                txn.drop(db, delete=False)
            donors_db = self.named_db(b"donors", txn=txn)
            if donors_db is not None:
                txn.drop(donors_db, delete=False)
            vectors.drop_in(self, txn)
            txn.put(b"used_bytes", _U64.pack(0), db=self._meta)
            return n

        return self._txn(write, write=True)

    def stats(self) -> StoreStats:
        """Fragment count, compressed and raw bytes, bytes on disk and the LMDB map size."""
        count = compressed = raw = 0
        for _key, head, _life, nbytes in self.iterate():
            count += 1
            compressed += nbytes
            raw += head.raw_nbytes if head is not None else 0
        disk = sum(p.stat().st_size for p in self.path.glob("*.mdb"))
        return StoreStats(count, compressed, raw, disk, self._env.info()["map_size"], self.dropped_corrupt)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return getattr(self, "_closed", False)

    def close(self) -> None:
        """Close the LMDB environment and release the store's locks (idempotent)."""
        with self._lock:
            self._closed = True
            self._env.close()
            self.pins.close()
            self._release_locks()

    def __enter__(self) -> "FragmentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

