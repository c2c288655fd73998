"""A donor record, the value under a fragment's key in the ``donors`` database
(``companions.py``): the namespace digest (32 bytes), ``<I`` token count n, n ``<i4`` token IDs
from position 0 (``schema.token_bytes``), then the text the semantic lookup embeds (UTF-8)."""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgesync_store.schema import token_bytes

log = logging.getLogger(__name__)

COUNT = struct.Struct("<I")


@dataclass(frozen=True)
class DonorRecord:
    """One donor: its namespace digest (32 bytes), token IDs (int32 ``[n]``) and embedded text."""

    namespace_digest: bytes
    tokens: np.ndarray
    text: str


def check_key(key: bytes) -> None:
    """Raises ValueError when ``key`` is not a 32-byte store key."""
    if not isinstance(key, bytes) or len(key) != 32:
        raise ValueError(f"key: expected a 32-byte store key, got {key!r:.40}")


def donor_value(namespace_digest: bytes, tokens: Sequence[int] | np.ndarray, text: str = "") -> bytes:
    """The record of ``tokens`` in the namespace ``namespace_digest`` with ``text``. Raises
    ValueError when ``namespace_digest`` is not 32 bytes or ``tokens`` is empty."""
    if not isinstance(namespace_digest, bytes) or len(namespace_digest) != 32:
        raise ValueError(f"namespace_digest: expected 32 bytes, got {namespace_digest!r:.40}")
    if len(tokens) == 0:
        raise ValueError("tokens: empty")
    return namespace_digest + COUNT.pack(len(tokens)) + token_bytes(tokens) + text.encode("utf-8")


def parse_donor(key: bytes, value: bytes) -> DonorRecord | None:
    """The record ``value`` of fragment ``key``; None (logged) when malformed."""
    head = 32 + COUNT.size
    if len(value) < head:
        log.warning("donor record %s: %d bytes, too short; ignored", key.hex()[:16], len(value))
        return None
    (n,) = COUNT.unpack_from(value, 32)
    end = head + 4 * n
    if len(value) < end or n == 0:
        log.warning("donor record %s: claims %d tokens in %d bytes; ignored", key.hex()[:16], n, len(value))
        return None
    try:
        text = value[end:].decode("utf-8")
    except UnicodeDecodeError:
        log.warning("donor record %s: text is not UTF-8; ignored", key.hex()[:16])
        return None
    return DonorRecord(value[:32], np.frombuffer(value[head:end], dtype="<i4").astype(np.int32), text)
