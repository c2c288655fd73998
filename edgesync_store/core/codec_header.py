"""The JSON header of a fragment blob (``codec``): parsed once per distinct header bytes.

:func:`parsed_json` reads the fields every blob needs to find its token IDs; :func:`header_fields`
turns the rest into ``codec.FragmentHeader``'s fields. Both are memoized by the header's bytes
(never mutate what they return) and raise ``CodecError`` naming what is wrong.
"""

from __future__ import annotations

import functools
import json

from edgesync_store.errors import CodecError
from edgesync_store.schema import EMBEDDING_DIM, Namespace

COMPRESSIONS = ("none", "zstd")
"""Payload encodings, the default first."""
V_ORDERS = ("token", "channel")
"""How V lies in an uncompressed payload: ``[layers, span, width]`` or ``[layers, width, span]``."""


_HEADER_MEMO = 2048
"""Parsed JSON headers kept, by their bytes (:func:`parsed_json`, :func:`header_fields`): a
prefix walk peeks the same fragments request after request, and parsing the JSON and its
namespace is most of a peek (``docs/measurements.md``)."""


@functools.lru_cache(maxsize=_HEADER_MEMO)
def parsed_json(header_bytes: bytes) -> tuple[dict, int, int]:
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
def header_fields(header_bytes: bytes, version: int) -> dict:
    """The :class:`FragmentHeader` fields but ``token_ids`` and the offsets of a header whose
    JSON :func:`parsed_json` accepted; memoized, so never mutate the dict. Raises CodecError."""
    header = parsed_json(header_bytes)[0]
    try:
        fields = dict(
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
            compression=str(header.get("compression", "zstd")) if version >= 2 else "zstd",
            v_order=str(header.get("v_order", "token")) if version >= 2 else "token",
            version=version,
        )
    except (ValueError, KeyError, TypeError, OverflowError, AttributeError) as exc:
        raise CodecError(f"header: {exc}") from None
    if fields["compression"] not in COMPRESSIONS:
        raise CodecError(f"compression: {fields['compression']!r} is not one of {', '.join(COMPRESSIONS)}")
    if fields["v_order"] not in V_ORDERS:
        raise CodecError(f"v_order: {fields['v_order']!r} is not one of {', '.join(V_ORDERS)}")
    return fields
