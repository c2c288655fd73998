"""Fragment <-> bytes: a versioned head (header, token IDs, checksum), then the tensors.

Blob layout (version 2, all integers little-endian)::

    offset  size            field
    0       4               magic b"ESKV"
    4       2               format version (u16) = 2
    6       4               header_len (u32): length of the JSON header
    10      header_len      JSON header (UTF-8): namespace, ranges, hashes, times, dtype, shape,
                            raw_nbytes, payload_nbytes, compression, v_order
    ..      4 * span        token IDs (<i4)
    ..      4 * emb_dim     embedding (<f4), emb_dim 0 or 384
    ..      8               xxh3_64 of everything above: the end of the "head"
    ..      0-63            zero bytes, so that the payload starts at a multiple of 64
    ..      payload_nbytes  the payload: K then V
    ..      8               xxh3_64 of the payload

Payload by ``compression``: ``"none"``, K ``[layers, span, width]`` C-order then V in
``v_order`` (``"token"``, the same, or ``"channel"``, ``[layers, width, span]``: llama.cpp's
``v_trans``); ``"zstd"``, one zstd frame of the byte planes of K then V (``zstd_planes``).
Nothing read is unpickled. Format-1 blobs are read too (``codec_v1``); :func:`encode` writes 2.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from edgesync_store.core import codec_v1, zstd_planes
from edgesync_store.core.codec_header import COMPRESSIONS, header_fields, parsed_json
from edgesync_store.errors import CodecError
from edgesync_store.schema import KVFragment, Namespace

MAGIC = b"ESKV"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
DEFAULT_MAX_RAW_BYTES = 256 * 1024 * 1024
"""Cap on a fragment's decompressed K+V size (bytes); a 2,048-token SmolLM2 fragment is 47 MB."""
DEFAULT_COMPRESSION = "none"
PAYLOAD_ALIGN = 64
"""The payload starts at a multiple of this many bytes from the blob's start."""

PREFIX = struct.Struct("<4sHI")
"""magic, version, header_len: the first 10 bytes of every blob version."""
_SUM = struct.Struct("<Q")
MAX_HEADER_BYTES = 64 * 1024
HEAD_MEMO = 4096
"""Heads kept parsed, by their bytes."""


def checksum(data) -> int:
    """xxh3_64 of a bytes-like object (no copy)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class FragmentHeader:
    """Everything in a blob but the tensors; read without touching them (:func:`peek`).

    ``token_ids`` is int32 ``[span]``; ``raw_nbytes`` and ``payload_nbytes`` are bytes;
    ``shape`` is K's ``[layers, span, width]``; ``head_nbytes`` is the head's length and
    ``payload_at`` the payload's offset in the blob (bytes).
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
    compression: str = "zstd"
    v_order: str = "token"
    version: int = FORMAT_VERSION
    head_nbytes: int = 0
    payload_at: int = 0

    @property
    def span(self) -> int:
        """Number of tokens."""
        return self.token_end - self.token_start

    @property
    def layers(self) -> range:
        """Model layers held."""
        return range(self.layer_start, self.layer_end, self.layer_stride)

    @property
    def blob_nbytes(self) -> int:
        """The whole blob's length in bytes (head, padding, payload and its checksum)."""
        return self.payload_at + self.payload_nbytes + (_SUM.size if self.version >= 2 else 4)


def _v_order(values: np.ndarray) -> tuple[str, np.ndarray]:
    """How ``values`` ``[layers, span, width]`` lies in memory and the C-contiguous array to
    write: ``("channel", [layers, width, span])`` for a transposed view (an engine's staged
    layout), else ``("token", [layers, span, width])``."""
    if not values.flags.c_contiguous and values.transpose(0, 2, 1).flags.c_contiguous:
        return "channel", values.transpose(0, 2, 1)
    return "token", np.ascontiguousarray(values)


def encode(fragment: KVFragment, compression: str = DEFAULT_COMPRESSION) -> bytes:
    """A format-2 blob of ``fragment``; V in the order it lies in memory (a transposed view is
    written ``"channel"``). Hit counters are not in the blob (the store keeps them apart).
    ValueError: ``compression`` not in :data:`COMPRESSIONS`."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    dtype = fragment.namespace.np_dtype
    keys = np.ascontiguousarray(fragment.keys)
    v_order, values = _v_order(fragment.values)
    raw_nbytes = keys.nbytes + values.nbytes
    payload = zstd_planes.compress(keys, values) if compression == "zstd" else None
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
        "shape": list(keys.shape),
        "embedding_dim": int(fragment.embedding.size),
        "raw_nbytes": raw_nbytes,
        "payload_nbytes": raw_nbytes if payload is None else len(payload),
        "compression": compression,
        "v_order": v_order,
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    head = b"".join((
        PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes)),
        header_bytes,
        fragment.token_ids.astype("<i4").tobytes(),
        fragment.embedding.astype("<f4").tobytes(),
    ))
    head += _SUM.pack(checksum(head))
    payload_at = -(-len(head) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    size = payload_at + header["payload_nbytes"] + _SUM.size
    out = bytearray(size)
    out[:len(head)] = head
    body = memoryview(out)[payload_at:size - _SUM.size]
    if payload is None:
        dest = np.frombuffer(body, dtype=np.uint8)
        dest[:keys.nbytes] = keys.reshape(-1).view(np.uint8)
        dest[keys.nbytes:] = values.reshape(-1).view(np.uint8)
    else:
        body[:] = payload
    _SUM.pack_into(out, size - _SUM.size, checksum(body))
    return bytes(out)


def _parse_head(blob) -> tuple[FragmentHeader, np.ndarray]:
    """The verified header and float32 embedding of a blob or head (read-only, shared)."""
    view = memoryview(blob)
    if len(view) < PREFIX.size:
        raise CodecError(f"blob: {len(view)} bytes is too short for a fragment")
    magic, version, header_len = PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"magic: {bytes(magic)!r} is not {MAGIC!r}")
    if version not in READABLE_VERSIONS:
        raise CodecError(f"version: blob format {version}, this code reads {READABLE_VERSIONS}")
    if header_len > MAX_HEADER_BYTES or PREFIX.size + header_len > len(view):
        raise CodecError(f"header_len: {header_len} does not fit the {len(view)}-byte blob")
    _, span, emb_dim = parsed_json(bytes(view[PREFIX.size : PREFIX.size + header_len]))
    sum_at = PREFIX.size + header_len + 4 * span + 4 * emb_dim
    head_end = sum_at + (_SUM.size if version >= 2 else codec_v1.CRC.size)
    if head_end > len(view):
        raise CodecError("blob: truncated inside the token IDs or embedding")
    return _verified_head(bytes(view[:head_end]))


@functools.lru_cache(maxsize=HEAD_MEMO)
def _verified_head(head: bytes) -> tuple[FragmentHeader, np.ndarray]:
    """:func:`_parse_head` of a head's exact bytes, memoized by them; raises CodecError."""
    view = memoryview(head)
    _magic, version, header_len = PREFIX.unpack_from(view, 0)
    header_bytes = bytes(view[PREFIX.size : PREFIX.size + header_len])
    _, span, emb_dim = parsed_json(header_bytes)
    ids_at = PREFIX.size + header_len
    emb_at = ids_at + 4 * span
    sum_at = emb_at + 4 * emb_dim
    if version == 1:
        head_end = payload_at = codec_v1.check_head(view, sum_at)
    else:
        (stored,) = _SUM.unpack_from(view, sum_at)
        if checksum(view[:sum_at]) != stored:
            raise CodecError("head checksum: xxh3 mismatch (corrupt header or token IDs)")
        head_end = sum_at + _SUM.size
        payload_at = -(-head_end // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    token_ids = np.frombuffer(view[ids_at:emb_at], dtype="<i4").astype(np.int32)
    embedding = np.frombuffer(view[emb_at:sum_at], dtype="<f4").astype(np.float32)
    token_ids.flags.writeable = embedding.flags.writeable = False
    return FragmentHeader(token_ids=token_ids, head_nbytes=head_end, payload_at=payload_at,
                          **header_fields(header_bytes, version)), embedding


def peek(blob) -> FragmentHeader:
    """A blob's (or a head's: :func:`head_of`) header, token IDs read-only and shared, without
    the tensors; checksum verified once per distinct head bytes. Raises CodecError when bad."""
    return _parse_head(blob)[0]


def head_of(blob) -> bytes:
    """The head of a blob (header to head checksum), as the ``heads`` database holds it. Raises
    CodecError when the head does not parse or the payload does not fit the blob."""
    head = peek(blob)
    if head.blob_nbytes != len(blob):
        raise CodecError(f"payload_nbytes: header says {head.payload_nbytes}, the blob's length disagrees")
    return bytes(memoryview(blob)[:head.head_nbytes])


def _checked_shape(head: FragmentHeader, max_raw_bytes: int) -> None:
    """Refuse a header whose shape and sizes disagree, or over the cap (before allocating)."""
    shape = head.shape
    if len(shape) != 3 or any(d <= 0 for d in shape):
        raise CodecError(f"shape: {shape} is not [layers, span, width]")
    expected_raw = 2 * shape[0] * shape[1] * shape[2] * head.namespace.np_dtype.itemsize  # Python ints: no wrap
    if head.raw_nbytes != expected_raw:
        raise CodecError(f"raw_nbytes: header says {head.raw_nbytes}, shape {shape} implies {expected_raw}")
    if head.raw_nbytes > max_raw_bytes:
        raise CodecError(f"raw_nbytes: {head.raw_nbytes} bytes exceeds the cap of {max_raw_bytes} bytes")
    if head.compression == "none" and head.payload_nbytes != head.raw_nbytes:
        raise CodecError(f"payload_nbytes: {head.payload_nbytes} for an uncompressed payload of {head.raw_nbytes}")


def _tensors(head: FragmentHeader, payload: memoryview, copy: bool) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[layers, span, width]`` from a verified payload."""
    dtype, shape = head.namespace.np_dtype, head.shape
    half = head.raw_nbytes // 2
    v_shape = (shape[0], shape[2], shape[1]) if head.v_order == "channel" else shape
    if head.compression == "zstd":
        raw = zstd_planes.decompress(payload, head.raw_nbytes)
        keys = zstd_planes.unshuffle(raw[:half], dtype, shape)
        values = zstd_planes.unshuffle(raw[half:], dtype, v_shape)
    else:
        le = dtype.newbyteorder("<")
        keys = np.frombuffer(payload, dtype=le, count=half // dtype.itemsize).reshape(shape)
        values = np.frombuffer(payload, dtype=le, offset=half).reshape(v_shape)
        if copy:
            keys, values = keys.copy(), values.copy()
        keys, values = keys.view(dtype), values.view(dtype)
    return keys, values.transpose(0, 2, 1) if head.v_order == "channel" else values


def payload_check(blob) -> tuple[memoryview, int]:
    """(payload of a format-2 blob, its expected xxh3_64), for :func:`decode` with
    ``check_payload=False``. Raises CodecError for a bad head or a format-1 blob."""
    view = memoryview(blob)
    head = _parse_head(view)[0]
    if head.version < 2:
        raise CodecError(f"version: format {head.version} payloads are checked by decode only")
    payload_end = head.payload_at + head.payload_nbytes
    if payload_end + _SUM.size != len(view):
        raise CodecError(f"payload_nbytes: header says {head.payload_nbytes}, the blob's length disagrees")
    return view[head.payload_at:payload_end], _SUM.unpack_from(view, payload_end)[0]


def decode(blob, max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES, *, copy: bool = True,
           check_payload: bool = True) -> KVFragment:
    """Parse, verify and decode a blob (format 1 or 2) into a :class:`KVFragment`.

    Args:
        max_raw_bytes: refuse blobs declaring more decompressed bytes (before allocating).
        copy: False returns an uncompressed payload's K and V as views of ``blob`` (valid as
            long as its memory is); a compressed one is always decoded into arrays of its own.
        check_payload: False skips an uncompressed format-2 payload's checksum read in place
            (the caller checks it apart: :func:`payload_check`).

    Raises CodecError (a ``ValueError``) for a corrupt, truncated or crafted blob, a size over
    ``max_raw_bytes`` or a wrong content hash; the message names what.
    """
    view = memoryview(blob)
    head, embedding = _parse_head(view)  # once: it checksums the head
    _checked_shape(head, max_raw_bytes)
    payload_end = head.payload_at + head.payload_nbytes
    if head.blob_nbytes != len(view):
        held = len(view) - head.blob_nbytes + head.payload_nbytes
        raise CodecError(f"payload_nbytes: header says {head.payload_nbytes}, blob holds {held}")
    if any(view[head.head_nbytes:head.payload_at]):
        raise CodecError("padding: the bytes between the head and the payload are not zero")
    payload = view[head.payload_at:payload_end]
    if head.version == 1:
        codec_v1.check_payload(view, payload, payload_end)
    elif check_payload or copy or head.compression != "none":
        (stored,) = _SUM.unpack_from(view, payload_end)
        if checksum(payload) != stored:
            raise CodecError("payload checksum: xxh3 mismatch (corrupt tensors)")
    keys, values = _tensors(head, payload, copy)
    try:
        return KVFragment(
            namespace=head.namespace,
            token_start=head.token_start,
            token_end=head.token_end,
            layer_start=head.layer_start,
            layer_end=head.layer_end,
            layer_stride=head.layer_stride,
            head_start=head.head_start,
            head_end=head.head_end,
            keys=keys,
            values=values,
            token_ids=head.token_ids,
            prefix_hash=head.prefix_hash,
            content_hash=head.content_hash,
            embedding=embedding,
            created_at=head.created_at,
            expires_at=head.expires_at,
        )
    except ValueError as exc:
        raise CodecError(f"fragment invariant: {exc}") from None
