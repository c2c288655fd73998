"""FragmentStore: KV fragments in LMDB, shared by the processes of one device.

One LMDB environment (a directory created mode 0700: it holds users' prompts) with four
named databases:

* ``fragments``: store key (32 bytes, ``schema.store_key``) -> blob (``codec``);
* ``by_prefix`` (dupsort): namespace digest + prefix hash (64 bytes) -> store keys of the
  fragments that start right after that prefix; the prefix walk's index;
* ``lifecycle``: store key -> hit_count (u32), last_hit_at, expires_at (f64 Unix seconds);
  kept apart from the blob so that a hit never rewrites tensors;
* ``meta``: store-wide facts (``format_version``).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb
import numpy as np

from . import codec
from .codec import CodecError, FragmentHeader
from .schema import KVFragment, Namespace, common_prefix_len, prefix_hasher, token_bytes

log = logging.getLogger("edgesync.store")

STORE_FORMAT_VERSION = 1
"""On-disk layout version recorded in the ``meta`` database."""
DEFAULT_MAP_SIZE = 256 * 1024 * 1024
"""Initial LMDB map size in bytes; doubled whenever a write finds it full (sparse on Linux)."""
MAX_MAP_SIZE = 1 << 40

_LIFECYCLE = struct.Struct("<Idd")
T = TypeVar("T")


class StoreFormatError(RuntimeError):
    """The store on disk has a format this code cannot read."""


class StoreOpenError(RuntimeError):
    """The store path cannot hold or does not hold a store (a file, a foreign non-empty
    directory, no permission, not LMDB); the message names the path and the reason."""


@dataclass
class Lifecycle:
    """Mutable per-fragment counters: hits, last hit and expiry (Unix seconds)."""

    hit_count: int = 0
    last_hit_at: float = 0.0
    expires_at: float = 0.0

    def pack(self) -> bytes:
        return _LIFECYCLE.pack(self.hit_count, self.last_hit_at, self.expires_at)

    @classmethod
    def unpack(cls, data: bytes | memoryview | None) -> "Lifecycle":
        if data is None or len(data) != _LIFECYCLE.size:
            return cls()
        return cls(*_LIFECYCLE.unpack(bytes(data)))


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
        readonly: open without writing (no growth, no removal of corrupt entries).

    A new directory is created with mode 0700 (it will hold users' prompts); an existing
    directory's mode is left alone.

    Raises:
        StoreFormatError: the store was written by a newer format version.
        StoreOpenError: the path is a file, a non-empty directory without a store, cannot be
            created, or does not open as LMDB (read-only: holds no store).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        map_size: int = DEFAULT_MAP_SIZE,
        max_raw_bytes: int = codec.DEFAULT_MAX_RAW_BYTES,
        readonly: bool = False,
    ) -> None:
        self.path = Path(path).expanduser()
        self.max_raw_bytes = max_raw_bytes
        self.readonly = readonly
        self.dropped_corrupt = 0
        if not str(path).strip():
            raise StoreOpenError("store path: is empty")
        try:
            str(self.path).encode("utf-8")
        except UnicodeEncodeError:
            raise StoreOpenError(f"store path {self.path!r}: is not valid UTF-8 (LMDB needs it)") from None
        if self.path.exists() and not self.path.is_dir():
            raise StoreOpenError(f"store path {self.path}: exists and is not a directory")
        if self.path.is_dir() and not (self.path / "data.mdb").exists():
            others = [p.name for p in self.path.iterdir() if p.name != "lock.mdb"]
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
                raise StoreOpenError(f"cannot create the store directory {self.path}: {exc}") from None
        self._lock = threading.RLock()
        try:
            self._env = lmdb.open(
                str(self.path),
                map_size=map_size,
                subdir=True,
                max_dbs=8,
                mode=0o600,
                readonly=readonly,
                # a read-only look at a store we cannot write (another user's, read-only media)
                lock=not readonly or os.access(self.path, os.W_OK),
                readahead=False,
                meminit=False,
                max_readers=256,
            )
        except lmdb.Error as exc:
            raise StoreOpenError(f"cannot open the store at {self.path}: {exc}") from None
        self._check_is_edgesync_lmdb()
        for _ in range(64):
            try:
                self._fragments = self._env.open_db(b"fragments", create=not readonly)
                self._by_prefix = self._env.open_db(b"by_prefix", dupsort=True, create=not readonly)
                self._lifecycle = self._env.open_db(b"lifecycle", create=not readonly)
                self._meta = self._env.open_db(b"meta", create=not readonly)
                break
            except lmdb.MapResizedError:  # another process grew the map since lmdb.open
                self._env.set_mapsize(0)
        self._check_format()

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
        with self._env.begin() as txn:
            names = {bytes(k) for k, _ in txn.cursor()}
        # named databases are created one transaction each, so a store another process is
        # creating right now may show only some of ours: any one of them marks an EdgeSync store
        if names and not names & {b"fragments", b"by_prefix", b"lifecycle", b"meta"}:
            self._env.close()
            raise StoreOpenError(f"store path {self.path}: holds an LMDB database that is not an EdgeSync store")

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

    def _check_format(self) -> None:
        def read(txn: lmdb.Transaction) -> bytes | None:
            value = txn.get(b"format_version", db=self._meta)
            return bytes(value) if value is not None else None

        found = self._txn(read)
        if found is None:
            if not self.readonly:
                self._txn(lambda txn: txn.put(b"format_version", str(STORE_FORMAT_VERSION).encode(), db=self._meta), write=True)
            return
        try:
            version = int(found)
        except ValueError:
            raise StoreFormatError(f"store {self.path}: format_version {found[:20]!r} is not a number") from None
        if version > STORE_FORMAT_VERSION:
            raise StoreFormatError(
                f"store {self.path} has format version {version}; this EdgeSync reads up to {STORE_FORMAT_VERSION}"
            )

    # -- writes ---------------------------------------------------------------------------

    def put(self, fragment: KVFragment) -> bool:
        """Store a fragment; return False (and write nothing) when its key is already there."""
        return self.put_many([fragment]) == 1

    def put_many(self, fragments: Sequence[KVFragment], now: float | None = None) -> int:
        """Store fragments in one write transaction; return how many were new.

        A fragment whose key is stored and live is left alone; one whose stored twin has
        expired (``expires_at <= now``) replaces it with fresh lifecycle counters. Encoding
        (compression) happens before the transaction so the writer lock is held only for the
        copy into LMDB.
        """
        now = time.time() if now is None else now
        encoded = [(f.key(), f.namespace.digest() + f.prefix_hash, codec.encode(f), f) for f in fragments]

        def write(txn: lmdb.Transaction) -> int:
            added = 0
            for key, index_key, blob, frag in encoded:
                if not txn.put(key, blob, db=self._fragments, overwrite=False):
                    if Lifecycle.unpack(txn.get(key, db=self._lifecycle)).expires_at > now:
                        continue
                    txn.put(key, blob, db=self._fragments)
                txn.put(index_key, key, db=self._by_prefix, dupdata=True)
                txn.put(key, Lifecycle(frag.hit_count, frag.last_hit_at, frag.expires_at).pack(), db=self._lifecycle)
                added += 1
            return added

        return self._txn(write, write=True)

    def delete(self, key: bytes) -> bool:
        """Remove a fragment and its index entries; return False when it was not there."""

        def write(txn: lmdb.Transaction) -> bool:
            return self._delete_in(txn, key)

        return self._txn(write, write=True)

    def _delete_in(self, txn: lmdb.Transaction, key: bytes) -> bool:
        blob = txn.get(key, db=self._fragments)
        if blob is None:
            return False
        try:
            head = codec.peek(blob)
            txn.delete(head.namespace.digest() + head.prefix_hash, key, db=self._by_prefix)
        except CodecError:
            pass  # a dangling by_prefix entry is dropped by the next walk that meets it
        txn.delete(key, db=self._fragments)
        txn.delete(key, db=self._lifecycle)
        return True

    def record_hits(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Add one hit to each fragment (hit_count += 1, last_hit_at = now)."""
        now = time.time() if now is None else now

        def write(txn: lmdb.Transaction) -> None:
            for key in keys:
                if txn.get(key, db=self._fragments) is None:
                    continue
                life = Lifecycle.unpack(txn.get(key, db=self._lifecycle))
                life.hit_count += 1
                life.last_hit_at = now
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
        """True when a fragment is stored under ``key`` and has not expired at ``now``."""
        now = time.time() if now is None else now

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

    def stats(self) -> StoreStats:
        """Fragment count, compressed and raw bytes, bytes on disk and the LMDB map size."""
        count = compressed = raw = 0
        for _key, head, _life, nbytes in self.iterate():
            count += 1
            compressed += nbytes
            raw += head.raw_nbytes if head is not None else 0
        disk = sum(p.stat().st_size for p in self.path.glob("*.mdb"))
        return StoreStats(count, compressed, raw, disk, self._env.info()["map_size"], self.dropped_corrupt)

    def prefix_walk(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray, now: float | None = None) -> PrefixMatch:
        """Find the longest run of stored fragments matching ``tokens`` from position 0.

        At each position the walk looks up the fragments stored after exactly this prefix
        (namespace digest + prefix hash), keeps those of ``namespace`` that are not expired,
        groups them by token span, and keeps groups that together hold every layer and KV
        head. A group whose tokens all match leads on to its end position; one that matches
        only a head ends a path as a partial span. The walk returns the path that reaches
        furthest (a depth-first search with one lookup per position, since spans of other
        chunk sizes branch). Reads headers only; corrupt or dangling entries met on the way
        are removed.

        Args:
            namespace: only fragments of this namespace are considered.
            tokens: the prompt's token IDs.
            now: Unix seconds for the expiry check (default: ``time.time()``).
        """
        now = time.time() if now is None else now
        tokens = np.asarray(tokens, dtype=np.int32)
        ns_digest = namespace.digest()
        ns_dict = namespace.to_dict()
        full = {(layer, head) for layer in range(namespace.n_layer) for head in range(namespace.n_head_kv)}
        hasher = prefix_hasher()
        result = PrefixMatch()
        corrupt: list[tuple[bytes, bytes | None]] = []

        def groups_at(txn: lmdb.Transaction, cursor: lmdb.Cursor, pos: int, digest: bytes) -> list[SpanMatch]:
            """The complete-coverage span groups stored right after ``tokens[:pos]``."""
            index_key = ns_digest + digest
            keys = [bytes(k) for k in cursor.iternext_dup()] if cursor.set_key(index_key) else []
            groups: dict[tuple[int, bytes], list] = {}
            for key in keys:
                blob = txn.get(key, db=self._fragments)
                if blob is None:
                    corrupt.append((key, index_key))
                    continue
                try:
                    head = codec.peek(blob)
                except CodecError:
                    corrupt.append((key, None))
                    continue
                life = Lifecycle.unpack(txn.get(key, db=self._lifecycle))
                if head.namespace.to_dict() != ns_dict or head.token_start != pos or life.expires_at <= now:
                    continue
                group = groups.setdefault((head.token_end, head.token_ids.tobytes()), [head, set(), [], 0])
                group[1].update((layer, h) for layer in head.layers for h in range(head.head_start, head.head_end))
                group[2].append(key)
                group[3] += len(blob)
            spans = []
            for head, covered, keys_, nbytes in groups.values():
                if covered == full:
                    matched = common_prefix_len(head.token_ids, tokens[pos : head.token_end])
                    if matched > 0:
                        spans.append(SpanMatch(keys_, pos, head.token_end, matched, nbytes))
            return spans

        def read(txn: lmdb.Transaction) -> None:
            cursor = txn.cursor(db=self._by_prefix)
            memo: dict[int, tuple[int, list[SpanMatch]]] = {}

            def best(pos: int, hasher) -> tuple[int, list[SpanMatch]]:
                # Longest reach from ``pos``: spans of other chunk sizes branch, so a greedy
                # choice of the longest complete span can end short of another branch.
                if pos in memo:
                    return memo[pos]
                found: tuple[int, list[SpanMatch]] = (pos, [])
                if pos < len(tokens):
                    for span in groups_at(txn, cursor, pos, hasher.digest()):
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

            result.spans[:] = best(0, hasher)[1]

        self._txn(read)
        for key, index_key in corrupt:
            if index_key is not None and not self.readonly:
                self._txn(lambda txn: txn.delete(index_key, key, db=self._by_prefix), write=True)
            elif index_key is None:
                self._drop_corrupt(key, "header does not parse")
        return result

    def close(self) -> None:
        """Close the LMDB environment (idempotent)."""
        with self._lock:
            self._env.close()

    def __enter__(self) -> "FragmentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

