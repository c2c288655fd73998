"""The ``"zstd"`` payload of a fragment blob (``codec``): the byte planes of K then V (every f16
element's low bytes, then its high bytes) in one zstd frame, level 1 (figures:
``docs/measurements.md``).
"""

from __future__ import annotations

import numpy as np
import zstandard

from edgesync_store.errors import CodecError

ZSTD_LEVEL = 1


def compress(keys: np.ndarray, values: np.ndarray) -> bytes:
    """One zstd frame (with its content size) of the byte planes of ``keys`` then ``values``
    (each written in its own C order)."""
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(shuffle(keys) + shuffle(values))


def shuffle(arr: np.ndarray) -> bytes:
    """Byte planes of ``arr``: all byte 0s, then all byte 1s, ... (little-endian elements)."""
    item = arr.dtype.itemsize
    flat = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).view(np.uint8)
    return flat.reshape(-1, item).T.tobytes() if item > 1 else flat.tobytes()


def unshuffle(data, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """Elements of ``dtype`` and ``shape`` from their byte planes (the inverse of :func:`shuffle`),
    built in whole-array passes (faster than strided byte writes: ``docs/measurements.md``)."""
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


def decompress(payload: memoryview, raw_nbytes: int) -> memoryview:
    """The zstd frame ``payload`` decompressed to exactly ``raw_nbytes`` bytes."""
    try:
        frame_size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise CodecError(f"payload: not a zstd frame ({exc})") from None
    if frame_size != raw_nbytes:
        raise CodecError(f"payload: zstd frame declares {frame_size} bytes, header {raw_nbytes}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_nbytes)
    except zstandard.ZstdError as exc:
        raise CodecError(f"payload: zstd decompression failed ({exc})") from None
    if len(raw) != raw_nbytes:
        raise CodecError(f"payload: decompressed {len(raw)} bytes, expected {raw_nbytes}")
    return memoryview(raw)


