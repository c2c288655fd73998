"""Store format 1, written directly with py-lmdb, for the migration and crash-safety tests.

Format 1 (before ``migrations/m0002_lifecycle_v2``): four named databases created together,
``fragments`` (store key -> ``codec`` blob), ``by_prefix`` (dupsort: namespace digest + prefix
hash -> store key), ``lifecycle`` (store key -> ``ttl.LIFECYCLE_V1`` ``<Idd``: hit_count,
last_hit_at, expires_at) and ``meta`` (``format_version`` b"1"; no ``used_bytes``, no
``max_bytes``). Nothing here goes through ``FragmentStore``, so a test of the migration does not
test the current code against itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import lmdb

from edgesync_store.core import codec
from edgesync_store.schema import KVFragment
from edgesync_store.ttl import LIFECYCLE_V1

V1_RECORD = tuple[int, float, float]
"""(hit_count, last_hit_at, expires_at) of a format-1 lifecycle record."""


def write_format1_store(path: Path, entries: Iterable[tuple[KVFragment, V1_RECORD | None]],
                        version: bytes = b"1") -> dict[bytes, bytes]:
    """Create a format-1 store at ``path`` holding ``entries`` (a fragment and its format-1
    lifecycle record, or None for a fragment without one); return ``{store key: blob}``."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=False)
    os.chmod(path, 0o700)
    blobs: dict[bytes, bytes] = {}
    env = lmdb.open(str(path), map_size=1 << 30, subdir=True, max_dbs=8, mode=0o600)
    try:
        with env.begin(write=True) as txn:
            fragments = env.open_db(b"fragments", txn=txn, create=True)
            by_prefix = env.open_db(b"by_prefix", txn=txn, dupsort=True, create=True)
            lifecycle = env.open_db(b"lifecycle", txn=txn, create=True)
            meta = env.open_db(b"meta", txn=txn, create=True)
            txn.put(b"format_version", version, db=meta)
            for frag, record in entries:
                key, blob = frag.key(), codec.encode(frag)
                assert key not in blobs, "two entries with one store key"
                blobs[key] = blob
                txn.put(key, blob, db=fragments)
                txn.put(frag.namespace.digest() + frag.prefix_hash, key, db=by_prefix, dupdata=True)
                if record is not None:
                    txn.put(key, LIFECYCLE_V1.pack(*record), db=lifecycle)
    finally:
        env.close()
    return blobs


def dump(path: Path) -> dict[bytes, list[tuple[bytes, bytes]]]:
    """Every record of the four core databases (``by_prefix`` with its duplicates), read with
    py-lmdb: what two stores must share to be identical."""
    env = lmdb.open(str(path), subdir=True, max_dbs=8, readonly=True, lock=False)
    try:
        out = {}
        with env.begin() as txn:
            for name, dup in ((b"fragments", False), (b"by_prefix", True), (b"lifecycle", False), (b"meta", False)):
                db = env.open_db(name, txn=txn, dupsort=dup, create=False)
                out[name] = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
        return out
    finally:
        env.close()


def on_disk_version(path: Path) -> bytes:
    """The ``format_version`` record, read with py-lmdb (no migration can run)."""
    env = lmdb.open(str(path), subdir=True, max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return bytes(txn.get(b"format_version", db=env.open_db(b"meta", txn=txn, create=False)))
    finally:
        env.close()
