"""Old store and blob formats, written directly (py-lmdb, struct, zlib, zstandard) for the codec,
migration and crash-safety tests.

Blob format 1 (what ``codec`` wrote before blob format 2; ``codec.decode`` still reads it,
``core/codec_v1.py``), all integers little-endian::

    0       4               magic b"ESKV"
    4       2               format version (u16) = 1
    6       4               header_len (u32)
    10      header_len      JSON header: today's fields but "compression" and "v_order", and
                            "shuffle": "byteplanes"
    ..      4 * span        token IDs (<i4)
    ..      4 * emb_dim     embedding (<f4)
    ..      4               crc32 of everything above (the head)
    ..      payload_nbytes  zstd frame (level 1, with its content size) of the byte planes of K,
                            then of V ([layers, span, width] both)
    ..      4               crc32 of the zstd frame

:func:`encode_v1` writes it with code of its own (nothing from ``codec``).

Store format 1 (before ``migrations/m0002_lifecycle_v2``): four named databases created
together, ``fragments`` (store key -> format-1 blob), ``by_prefix`` (dupsort: namespace digest +
prefix hash -> store key), ``lifecycle`` (store key -> ``ttl.LIFECYCLE_V1`` ``<Idd``: hit_count,
last_hit_at, expires_at) and ``meta`` (``format_version`` b"1"; no ``used_bytes``, no
``max_bytes``). Store format 2 (before ``migrations/m0003_heads``): the same databases with
``ttl.LIFECYCLE_V2`` records (``<IdddBQQ``), ``used_bytes`` (``<Q``, the sum of the blobs'
lengths) and ``format_version`` b"2"; no ``heads`` database. Its blobs are format 1: the code of
store format 2 wrote no other. Nothing here goes through ``FragmentStore``, so a test of a
migration does not test the current code against itself.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Iterable

import lmdb
import numpy as np
import zstandard

from edgesync_store.schema import KVFragment
from edgesync_store.ttl import LIFECYCLE_V1, LIFECYCLE_V2

V1_RECORD = tuple[int, float, float]
"""(hit_count, last_hit_at, expires_at) of a format-1 lifecycle record."""
V2_RECORD = tuple[int, float, float, float, int, int, int]
"""(hit_count, last_hit_at, expires_at, created_at, lifetime code (0 short, 1 long), nbytes,
raw_nbytes) of a format-2 lifecycle record; nbytes 0 is replaced by the blob's length."""

_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")


def _byte_planes(arr: np.ndarray) -> bytes:
    """All byte 0s of the little-endian elements of ``arr`` (in C order), then all byte 1s, ..."""
    item = arr.dtype.itemsize
    raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).view(np.uint8).reshape(-1, item)
    return b"".join(raw[:, i].tobytes() for i in range(item))


def encode_v1(frag: KVFragment) -> bytes:
    """``frag`` as a format-1 blob (module docstring)."""
    keys, values = np.ascontiguousarray(frag.keys), np.ascontiguousarray(frag.values)
    planes = _byte_planes(keys) + _byte_planes(values)
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(planes)
    header = {
        "namespace": frag.namespace.to_dict(),
        "token_start": frag.token_start,
        "token_end": frag.token_end,
        "layer_start": frag.layer_start,
        "layer_end": frag.layer_end,
        "layer_stride": frag.layer_stride,
        "head_start": frag.head_start,
        "head_end": frag.head_end,
        "prefix_hash": frag.prefix_hash.hex(),
        "content_hash": frag.content_hash,
        "created_at": frag.created_at,
        "expires_at": frag.expires_at,
        "dtype": frag.namespace.np_dtype.name,
        "shape": list(keys.shape),
        "embedding_dim": int(frag.embedding.size),
        "raw_nbytes": len(planes),
        "payload_nbytes": len(frame),
        "shuffle": "byteplanes",
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    head = (_PREFIX.pack(b"ESKV", 1, len(header_bytes)) + header_bytes
            + frag.token_ids.astype("<i4").tobytes() + frag.embedding.astype("<f4").tobytes())
    return head + _CRC.pack(zlib.crc32(head)) + frame + _CRC.pack(zlib.crc32(frame))


def v1_head_nbytes(blob: bytes) -> int:
    """The length of a format-1 blob's head (up to and with its crc32), from its header."""
    (header_len,) = struct.unpack_from("<I", blob, 6)
    header = json.loads(blob[10 : 10 + header_len])
    return 10 + header_len + 4 * (header["token_end"] - header["token_start"]) + 4 * header["embedding_dim"] + 4


def _create(path: Path) -> lmdb.Environment:
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=False)
    os.chmod(path, 0o700)
    return lmdb.open(str(path), map_size=1 << 30, subdir=True, max_dbs=8, mode=0o600)


def _core(env: lmdb.Environment, txn) -> tuple:
    return (env.open_db(b"fragments", txn=txn, create=True),
            env.open_db(b"by_prefix", txn=txn, dupsort=True, create=True),
            env.open_db(b"lifecycle", txn=txn, create=True),
            env.open_db(b"meta", txn=txn, create=True))


def _put_v1(txn, fragments, by_prefix, frag: KVFragment, blobs: dict[bytes, bytes]) -> tuple[bytes, bytes]:
    """Write ``frag`` as a format-1 blob with its ``by_prefix`` entry; record it in ``blobs``."""
    key, blob = frag.key(), encode_v1(frag)
    assert key not in blobs, "two entries with one store key"
    blobs[key] = blob
    txn.put(key, blob, db=fragments)
    txn.put(frag.namespace.digest() + frag.prefix_hash, key, db=by_prefix, dupdata=True)
    return key, blob


def write_format1_store(path: Path, entries: Iterable[tuple[KVFragment, V1_RECORD | None]],
                        version: bytes = b"1") -> dict[bytes, bytes]:
    """Create a format-1 store at ``path`` holding ``entries`` (a fragment and its format-1
    lifecycle record, or None for a fragment without one) as format-1 blobs; return
    ``{store key: blob}``."""
    blobs: dict[bytes, bytes] = {}
    env = _create(path)
    try:
        with env.begin(write=True) as txn:
            fragments, by_prefix, lifecycle, meta = _core(env, txn)
            txn.put(b"format_version", version, db=meta)
            for frag, record in entries:
                key, blob = _put_v1(txn, fragments, by_prefix, frag, blobs)
                if record is not None:
                    txn.put(key, LIFECYCLE_V1.pack(*record), db=lifecycle)
    finally:
        env.close()
    return blobs


def write_format2_store(path: Path, entries: Iterable[tuple[KVFragment, V2_RECORD]]) -> dict[bytes, bytes]:
    """Create a format-2 store at ``path`` holding ``entries`` (a fragment and its format-2
    lifecycle record) as format-1 blobs, with ``used_bytes``; return ``{store key: blob}``."""
    blobs: dict[bytes, bytes] = {}
    env = _create(path)
    try:
        with env.begin(write=True) as txn:
            fragments, by_prefix, lifecycle, meta = _core(env, txn)
            for frag, record in entries:
                key, blob = _put_v1(txn, fragments, by_prefix, frag, blobs)
                hits, last_hit, expires, created, lifetime, nbytes, raw = record
                txn.put(key, LIFECYCLE_V2.pack(hits, last_hit, expires, created, lifetime, nbytes or len(blob), raw),
                        db=lifecycle)
            txn.put(b"used_bytes", struct.pack("<Q", sum(map(len, blobs.values()))), db=meta)
            txn.put(b"format_version", b"2", db=meta)
    finally:
        env.close()
    return blobs


def edit(path: Path, fn) -> None:
    """Run ``fn(txn, env)`` in a write transaction of the store at ``path``, opened with py-lmdb
    (the store closed: one environment per file per process)."""
    env = lmdb.open(str(path), subdir=True, max_dbs=16, map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            fn(txn, env)
    finally:
        env.close()


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


def heads(path: Path) -> dict[bytes, bytes] | None:
    """The ``heads`` database (store key -> head) read with py-lmdb; None when it does not exist."""
    env = lmdb.open(str(path), subdir=True, max_dbs=16, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            try:
                db = env.open_db(b"heads", txn=txn, create=False)
            except lmdb.NotFoundError:
                return None
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=db)}
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
