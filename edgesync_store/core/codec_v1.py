"""The checksums of format-1 blobs, which ``codec.decode`` reads (stores written before
``migrations/m0003_heads``, and a remote tier shared with older nodes).

Format 1 differs from format 2 (``codec``'s docstring) only after the embedding::

    ..      4               crc32 of the head
    ..      payload_nbytes  zstd frame of the byte planes of K then V (V ``"token"`` order)
    ..      4               crc32 of the zstd frame

No padding, so the payload starts right after the head's crc32.
"""

from __future__ import annotations

import struct
import zlib

from edgesync_store.errors import CodecError

VERSION = 1
CRC = struct.Struct("<I")


def check_head(view: memoryview, crc_at: int) -> int:
    """Verify the crc32 of a format-1 head ending at ``crc_at``; return the payload's offset.
    Raises CodecError when truncated or the crc32 does not match."""
    if crc_at + CRC.size > len(view):
        raise CodecError("blob: truncated inside the token IDs or embedding")
    (stored,) = CRC.unpack_from(view, crc_at)
    if zlib.crc32(view[:crc_at]) != stored:
        raise CodecError("head checksum: crc32 mismatch (corrupt header or token IDs)")
    return crc_at + CRC.size


def check_payload(view: memoryview, payload: memoryview, payload_end: int) -> None:
    """Verify the crc32 after a format-1 payload; CodecError when it does not match."""
    (stored,) = CRC.unpack_from(view, payload_end)
    if zlib.crc32(payload) != stored:
        raise CodecError("payload checksum: crc32 mismatch (corrupt tensors)")
