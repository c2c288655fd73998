"""Fragment <-> bytes: a versioned header, the token IDs, zstd-compressed tensors, checksums.

Blob layout (version 1, all integers little-endian)::

    offset  size            field
    0       4               magic b"ESKV"
    4       2               format version (u16) = 1
    6       4               header_len (u32): length of the JSON header
    10      header_len      JSON header (UTF-8): namespace, ranges, hashes, times, dtype,
                            shapes, raw_nbytes, payload_nbytes, shuffle
    ..      4 * span        token IDs (<i4)
    ..      4 * emb_dim     embedding (<f4), emb_dim 0 or 384
    ..      4               crc32 of everything above (the "head")
    ..      payload_nbytes  zstd frame of the byte-shuffled K then V
    ..      4               crc32 of the zstd frame

The header is JSON and the arrays raw little-endian: nothing read is unpickled. Byte shuffling stores the low
bytes of every f16 element, then the high bytes (byte planes), which compresses better and
faster than plain f16 (ratio 1.17 against 1.08, ../shared/DESIGN.md 2.4). zstd level 1: higher levels
gain nothing on KV (same source).

Decoding refuses, with :class:`CodecError` (a ``ValueError``), a wrong magic or version, a bad
checksum, a header whose shapes disagree with its declared sizes, and any blob whose declared
decompressed size exceeds ``max_raw_bytes``; that check happens before any allocation. The
fragment's own invariants (``schema.KVFragment``) are checked last, which refuses a wrong
content hash.
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard

from edgesync_store.errors import CodecError
from edgesync_store.schema import EMBEDDING_DIM, KVFragment, Namespace

MAGIC = b"ESKV"
FORMAT_VERSION = 1
DEFAULT_MAX_RAW_BYTES = 256 * 1024 * 1024
"""Cap on a fragment's decompressed K+V size (bytes); a 2,048-token SmolLM2 fragment is 47 MB."""
ZSTD_LEVEL = 1

_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")
_MAX_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True)
class FragmentHeader:
    """Everything in a blob but the tensors; read without decompressing (:func:`peek`).

    ``token_ids`` is int32 ``[span]``; ``raw_nbytes`` and ``payload_nbytes`` are bytes.
    """

    namespace: Namespace
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    layer_stride: int
    head_start: int
    head_end: int
    prefix_hash: bytes
    content_hash: str
    created_at: float
    expires_at: float
    token_ids: np.ndarray
    raw_nbytes: int
    payload_nbytes: int
    shape: tuple

    @property
    def span(self) -> int:
        """Number of tokens."""
        return self.token_end - self.token_start

    @property
    def layers(self) -> range:
        """Model layers held."""
        return range(self.layer_start, self.layer_end, self.layer_stride)


def _shuffle(arr: np.ndarray) -> bytes:
    """Byte planes of ``arr``: all byte 0s, then all byte 1s, ... (little-endian elements)."""
    item = arr.dtype.itemsize
    flat = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).view(np.uint8)
    return flat.reshape(-1, item).T.tobytes() if item > 1 else flat.tobytes()


def _unshuffle(data: bytes | memoryview, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """Elements of ``dtype`` and ``shape`` from their byte planes (the inverse of :func:`_shuffle`).

    Each element is built in an unsigned integer of its size, the highest plane first, shifted
    left a byte per lower plane: whole-array passes with contiguous reads and writes (f16: 0.23
    ms per 1.5 MB against 0.57 ms for strided byte writes into the output, measured on this
    machine's numpy 2.4)."""
    item = dtype.itemsize
    planes = np.frombuffer(data, dtype=np.uint8).reshape(item, -1)
    if item == 1:
        out = planes[0].copy()
    else:
        out = planes[item - 1].astype(f"<u{item}")
        for i in range(item - 2, -1, -1):
            out <<= 8
            out |= planes[i]
    return out.view(dtype.newbyteorder("<")).reshape(shape).astype(dtype, copy=False)


def encode(fragment: KVFragment) -> bytes:
    """Serialise a fragment to a blob (layout in the module docstring).

    Lifecycle counters (``hit_count``, ``last_hit_at``) are not part of the blob: the store keeps
    them apart so a hit never rewrites the tensors.
    """
    dtype = fragment.namespace.np_dtype
    payload_raw = _shuffle(fragment.keys) + _shuffle(fragment.values)
    payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(payload_raw)
    header = {
        "namespace": fragment.namespace.to_dict(),
        "token_start": fragment.token_start,
        "token_end": fragment.token_end,
        "layer_start": fragment.layer_start,
        "layer_end": fragment.layer_end,
        "layer_stride": fragment.layer_stride,
        "head_start": fragment.head_start,
        "head_end": fragment.head_end,
        "prefix_hash": fragment.prefix_hash.hex(),
        "content_hash": fragment.content_hash,
        "created_at": fragment.created_at,
        "expires_at": fragment.expires_at,
        "dtype": dtype.name,
        "shape": list(fragment.keys.shape),
        "embedding_dim": int(fragment.embedding.size),
        "raw_nbytes": len(payload_raw),
        "payload_nbytes": len(payload),
        "shuffle": "byteplanes",
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    head = b"".join(
        (
            _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes)),
            header_bytes,
            fragment.token_ids.astype("<i4").tobytes(),
            fragment.embedding.astype("<f4").tobytes(),
        )
    )
    return b"".join((head, _CRC.pack(zlib.crc32(head)), payload, _CRC.pack(zlib.crc32(payload))))


_HEADER_MEMO = 2048
"""Parsed JSON headers kept, by their bytes (:func:`_parsed_json`, :func:`_header_fields`): a
prefix walk peeks the same fragments request after request, and parsing the JSON and its
namespace was most of a peek (about 45 of 60 us for a SmolLM2 header). About 3 KB each."""


@functools.lru_cache(maxsize=_HEADER_MEMO)
def _parsed_json(header_bytes: bytes) -> tuple[dict, int, int]:
    """The header JSON of a blob as (dict, span, embedding_dim); memoized, so never mutate the
    dict. Raises CodecError for JSON that is not a plausible fragment header."""
    try:
        header = json.loads(header_bytes)
        span = int(header["token_end"]) - int(header["token_start"])
        emb_dim = int(header["embedding_dim"])
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise CodecError(f"header: not a valid fragment header ({exc})") from None
    if not 0 <= span <= 1 << 20 or emb_dim not in (0, EMBEDDING_DIM):
        raise CodecError(f"header: implausible span {span} or embedding_dim {emb_dim}")
    return header, span, emb_dim


@functools.lru_cache(maxsize=_HEADER_MEMO)
def _header_fields(header_bytes: bytes) -> dict:
    """The :class:`FragmentHeader` fields but ``token_ids`` of a header whose JSON
    :func:`_parsed_json` accepted; memoized, so never mutate the dict. Raises CodecError."""
    header = _parsed_json(header_bytes)[0]
    try:
        return dict(
            namespace=Namespace.from_dict(header["namespace"]),
            token_start=int(header["token_start"]),
            token_end=int(header["token_end"]),
            layer_start=int(header["layer_start"]),
            layer_end=int(header["layer_end"]),
            layer_stride=int(header["layer_stride"]),
            head_start=int(header["head_start"]),
            head_end=int(header["head_end"]),
            prefix_hash=bytes.fromhex(header["prefix_hash"]),
            content_hash=str(header["content_hash"]),
            created_at=float(header["created_at"]),
            expires_at=float(header["expires_at"]),
            raw_nbytes=int(header["raw_nbytes"]),
            payload_nbytes=int(header["payload_nbytes"]),
            shape=tuple(int(x) for x in header["shape"]),
        )
    except (ValueError, KeyError, TypeError, OverflowError, AttributeError) as exc:
        raise CodecError(f"header: {exc}") from None


def _parse_head(blob: bytes | memoryview) -> tuple[bytes, np.ndarray, np.ndarray, int]:
    """Parse and verify the head; return (header JSON bytes, token_ids, embedding, payload
    offset)."""
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise CodecError(f"blob: {len(view)} bytes is too short for a fragment")
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"magic: {bytes(magic)!r} is not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"version: blob format {version}, this code reads {FORMAT_VERSION}")
    if header_len > _MAX_HEADER_BYTES or _PREFIX.size + header_len > len(view):
        raise CodecError(f"header_len: {header_len} does not fit the {len(view)}-byte blob")
    header_bytes = bytes(view[_PREFIX.size : _PREFIX.size + header_len])
    _, span, emb_dim = _parsed_json(header_bytes)
    ids_at = _PREFIX.size + header_len
    emb_at = ids_at + 4 * span
    crc_at = emb_at + 4 * emb_dim
    if crc_at + _CRC.size > len(view):
        raise CodecError("blob: truncated inside the token IDs or embedding")
    (stored_crc,) = _CRC.unpack_from(view, crc_at)
    if zlib.crc32(view[:crc_at]) != stored_crc:
        raise CodecError("head checksum: crc32 mismatch (corrupt header or token IDs)")
    token_ids = np.frombuffer(view[ids_at:emb_at], dtype="<i4").astype(np.int32)
    embedding = np.frombuffer(view[emb_at:crc_at], dtype="<f4").astype(np.float32)
    return header_bytes, token_ids, embedding, crc_at + _CRC.size


def peek(blob: bytes | memoryview) -> FragmentHeader:
    """Read a blob's header and token IDs without touching the tensors (the head's checksum is
    verified every time; the JSON parse is memoized by the header's bytes).

    Raises:
        CodecError: bad magic, version, checksum or header fields.
    """
    header_bytes, token_ids, _emb, _ = _parse_head(blob)
    return FragmentHeader(token_ids=token_ids, **_header_fields(header_bytes))


def decode(blob: bytes | memoryview, max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES) -> KVFragment:
    """Parse, verify and decompress a blob into a :class:`KVFragment`.

    Args:
        blob: bytes from :func:`encode` (a zero-copy LMDB buffer is fine).
        max_raw_bytes: refuse blobs declaring more decompressed bytes than this.

    Raises:
        CodecError: corrupt, truncated or crafted blob, a declared size over ``max_raw_bytes``
            (refused before allocating), or a fragment invariant violated (wrong content hash,
            shapes...); the message names what was wrong.
    """
    view = memoryview(blob)
    header_bytes, token_ids, embedding, payload_at = _parse_head(view)  # once: it checksums the head
    head = FragmentHeader(token_ids=token_ids, **_header_fields(header_bytes))
    ns = head.namespace
    dtype = ns.np_dtype
    shape = head.shape
    if len(shape) != 3 or any(d <= 0 for d in shape):
        raise CodecError(f"shape: {shape} is not [layers, span, width]")
    expected_raw = 2 * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if head.raw_nbytes != expected_raw:
        raise CodecError(f"raw_nbytes: header says {head.raw_nbytes}, shape {shape} implies {expected_raw}")
    if head.raw_nbytes > max_raw_bytes:
        raise CodecError(f"raw_nbytes: {head.raw_nbytes} bytes exceeds the cap of {max_raw_bytes} bytes")
    payload_end = payload_at + head.payload_nbytes
    if payload_end + _CRC.size != len(view):
        raise CodecError(
            f"payload_nbytes: header says {head.payload_nbytes}, blob holds {len(view) - payload_at - _CRC.size}"
        )
    payload = view[payload_at:payload_end]
    (stored_crc,) = _CRC.unpack_from(view, payload_end)
    if zlib.crc32(payload) != stored_crc:
        raise CodecError("payload checksum: crc32 mismatch (corrupt tensors)")
    try:
        frame_size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise CodecError(f"payload: not a zstd frame ({exc})") from None
    if frame_size != head.raw_nbytes:
        raise CodecError(f"payload: zstd frame declares {frame_size} bytes, header {head.raw_nbytes}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=head.raw_nbytes)
    except zstandard.ZstdError as exc:
        raise CodecError(f"payload: zstd decompression failed ({exc})") from None
    if len(raw) != head.raw_nbytes:
        raise CodecError(f"payload: decompressed {len(raw)} bytes, expected {head.raw_nbytes}")
    half = head.raw_nbytes // 2
    raw_view = memoryview(raw)
    try:
        return KVFragment(
            namespace=ns,
            token_start=head.token_start,
            token_end=head.token_end,
            layer_start=head.layer_start,
            layer_end=head.layer_end,
            layer_stride=head.layer_stride,
            head_start=head.head_start,
            head_end=head.head_end,
            keys=_unshuffle(raw_view[:half], dtype, shape),
            values=_unshuffle(raw_view[half:], dtype, shape),
            token_ids=head.token_ids,
            prefix_hash=head.prefix_hash,
            content_hash=head.content_hash,
            embedding=embedding,
            created_at=head.created_at,
            expires_at=head.expires_at,
        )
    except ValueError as exc:
        raise CodecError(f"fragment invariant: {exc}") from None
