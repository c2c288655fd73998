"""The reference writer of llama.cpp's seq-state bytes, the oracle the tests compare the
parser (``seqstate.parse_parts``) and the one-copy writer (``state_buffer.build``) with: cache
parts written field by field in the layout of ``edgesync_engines/adapters/seqstate.py``."""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from edgesync_engines.adapters.kv_layout import StateLayout
from edgesync_engines.adapters.seqstate import (
    CELL_EXT_BYTES,
    SEQ_STATE_MAGIC,
    CachePart,
    SeqStateError,
    ggml_type,
    text_cell_ext,
)


def to_parts(layout: StateLayout, k: np.ndarray, v: np.ndarray, tokens: Sequence[int]) -> list[CachePart]:
    """Cache parts holding positions 0..n-1 of ``k``, ``v`` ``[n_layer, n, width]`` in every part
    of ``layout`` (views, no copies)."""
    n = k.shape[1]
    pos = np.arange(n, dtype=np.int64)
    ext = text_cell_ext(pos, np.asarray(tokens[:n]), layout.pos_2d) if layout.cell_ext else None
    parts = []
    for i in range(len(layout.part_layers)):
        rows = layout.part_range(i)
        parts.append(CachePart(pos, ext, list(k[rows.start:rows.stop]), list(v[rows.start:rows.stop]),
                               layout.type_kv, layout.type_kv, layout.v_trans, layout.n_stream))
    return parts


def part_bytes(part: CachePart, ext_bytes: int) -> int:
    n = len(part.pos)
    size = 8 + (12 + ext_bytes) * n + 8 + 4 * (part.n_stream - 1)
    size += sum(12 + a.shape[1] * a.itemsize * n for a in part.k)
    size += sum(12 + a.shape[1] * a.itemsize * n for a in part.v)
    return size


def write_part(buf: bytearray, at: int, part: CachePart, ext_bytes: int, seq_id: int, stream: int = 0) -> int:
    """One part at ``at``: ``part.n_stream`` streams, the cells in stream ``stream``, the others
    empty (cell_count 0), as llama.cpp writes one sequence of a context with a stream per sequence."""
    n = len(part.pos)
    struct.pack_into("<I", buf, at, part.n_stream)
    at += 4 + 4 * stream  # the empty streams before it: zeros
    struct.pack_into("<I", buf, at, n)
    at += 4
    rec = (12 + ext_bytes) // 4
    cells = np.frombuffer(buf, dtype="<i4", count=rec * n, offset=at).reshape(n, rec)
    cells[:, 0] = part.pos
    cells[:, 1] = 1
    if ext_bytes:
        cells[:, 2:5] = part.ext
    cells[:, rec - 1] = seq_id
    at += 4 * rec * n
    struct.pack_into("<II", buf, at, int(part.v_trans), part.n_layer)
    at += 8
    tk, tv = ggml_type(part.type_k), ggml_type(part.type_v)
    for a in part.k:
        row = a.shape[1] * a.itemsize
        struct.pack_into("<iQ", buf, at, tk.code, row)
        at += 12
        np.frombuffer(buf, dtype=tk.dtype, count=n * a.shape[1], offset=at).reshape(n, -1)[:] = a
        at += n * row
    for a in part.v:
        width = a.shape[1]
        if part.v_trans:
            struct.pack_into("<iII", buf, at, tv.code, a.itemsize, width)
            at += 12
            np.frombuffer(buf, dtype=tv.dtype, count=n * width, offset=at).reshape(width, n)[:] = a.T
        else:
            struct.pack_into("<iQ", buf, at, tv.code, width * a.itemsize)
            at += 12
            np.frombuffer(buf, dtype=tv.dtype, count=n * width, offset=at).reshape(n, width)[:] = a
        at += n * width * a.itemsize
    return at + 4 * (part.n_stream - 1 - stream)  # the empty streams after it


def serialize_parts(parts: list[CachePart], seq_id: int = 0, stream: int = 0) -> bytearray:
    """Build ``llama_state_seq_set_data`` bytes from cache parts (global, then sliding window),
    as a writable ``bytearray`` ctypes hands over without a copy.

    Raises:
        SeqStateError: a part whose arrays disagree with its cell count, types or extension.
    """
    ext_bytes = CELL_EXT_BYTES if parts and parts[0].ext is not None else 0
    for i, p in enumerate(parts):
        n = len(p.pos)
        if n == 0 or len(p.k) != len(p.v):
            raise SeqStateError(f"part {i}: need cells and as many K as V layers")
        if any(a.ndim != 2 or a.shape[0] != n for a in (*p.k, *p.v)):
            raise SeqStateError(f"part {i}: every layer must be [{n}, width]")
        if (p.ext is not None) != bool(ext_bytes) or (p.ext is not None and p.ext.shape != (n, 3)):
            raise SeqStateError(f"part {i}: cell extensions must be [{n}, 3] in every part or in none")
        for a, t in ((p.k[0], p.type_k), (p.v[0], p.type_v)) if p.k else ():
            if np.dtype(ggml_type(t).dtype).itemsize != a.itemsize:
                raise SeqStateError(f"part {i}: {a.dtype} arrays do not hold ggml type {ggml_type(t).name}")
    total = 8 + sum(part_bytes(p, ext_bytes) for p in parts)
    buf = bytearray(total)
    struct.pack_into("<Ii", buf, 0, SEQ_STATE_MAGIC, seq_id)
    at = 8
    for p in parts:
        at = write_part(buf, at, p, ext_bytes, seq_id, stream)
    if at != total:
        raise SeqStateError(f"serialize wrote {at} of {total} bytes")
    return buf
