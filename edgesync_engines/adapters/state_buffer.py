"""One-copy llama.cpp seq-state buffers: stored K and V written straight into the bytes
``llama_state_seq_set_data`` reads (layout: ``seqstate``).

:func:`build` writes the headers and cells of positions 0..n-1 in every cache part and copies
each validated block (``kv_blocks.fragment_blocks``) through numpy views of the buffer: a part's
K rows are one view ``[layers, cells, width]`` (layers a constant stride apart), its V one
``[layers, width, cells]`` when transposed (``v_trans`` 1) or ``[layers, cells, width]``.
"""

from __future__ import annotations

import mmap
import struct
from typing import Callable, Sequence

import numpy as np

from edgesync_engines.adapters import seqstate
from edgesync_engines.adapters.kv_blocks import KVBlock
from edgesync_engines.adapters.kv_layout import StateLayout
from edgesync_store.schema import KVFragment

_HEAD = struct.Struct("<Ii")  # magic, seq_id
_PART = struct.Struct("<II")  # n_stream, cell_count; then v_trans, n_layer
_ROW = struct.Struct("<iQ")  # ggml type, row bytes (K; V not transposed)
_VT = struct.Struct("<iII")  # ggml type, el_size, n_embd_v_gqa (V transposed)


def state_bytes(layout: StateLayout, n_tokens: int) -> int:
    """Size in bytes of the seq state of ``n_tokens`` cells in every part of ``layout``."""
    row = layout.width * np.dtype(seqstate.ggml_type(layout.type_kv).dtype).itemsize
    cell = 12 + (seqstate.CELL_EXT_BYTES if layout.cell_ext else 0)
    per_part = 8 + cell * n_tokens + 8 + 4 * (layout.n_stream - 1)  # the other streams' cell_count 0
    return 8 + sum(per_part + n_layer * 2 * (12 + n_tokens * row) for n_layer in layout.part_layers)


TOUCH_BYTES = 4 << 20
"""Bytes :func:`room` touches between two ``should_stop`` checks, so that a request waits for
no more than that many bytes of page faults."""

ROOM_STEP = 256
"""Cells a buffer from :func:`room` is rounded up to: prompts of similar length share one buffer
rather than each longer one faulting in a new one."""


def room(layout: StateLayout, n_tokens: int, out: np.ndarray | None = None,
         should_stop: Callable[[], bool] | None = None) -> np.ndarray | None:
    """A buffer for :func:`build`'s ``out`` holding ``n_tokens`` cells: ``out`` when large
    enough, else a new one rounded up to :data:`ROOM_STEP` cells with every page touched now
    (not on the injection's path). ``should_stop`` is asked between :data:`TOUCH_BYTES` pieces;
    once True, ``out`` is returned as it was."""
    if out is not None and len(out) >= state_bytes(layout, n_tokens):
        return out
    buf = np.empty(state_bytes(layout, -(-n_tokens // ROOM_STEP) * ROOM_STEP), np.uint8)
    for at in range(0, len(buf), TOUCH_BYTES):
        if should_stop is not None and should_stop():
            return out
        buf[at:at + TOUCH_BYTES:mmap.PAGESIZE] = 0
    return buf


def build(layout: StateLayout, head_width: int, blocks: Sequence[KVBlock], n_tokens: int, tokens: Sequence[int],
          seq_id: int = 0, out: np.ndarray | None = None,
          start: int = 0) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The ``llama_state_seq_set_data`` bytes of positions ``start..n_tokens-1`` in every cache
    part, K and V copied from ``blocks`` (covering every layer, KV head and those positions);
    ``head_width``: items of one KV head in a row. Returns the writable uint8 buffer (its first
    ``state_bytes(layout, n_tokens - start)`` bytes; ``out`` when large enough) and, per part, K
    and V views of it ``[part layers, n_tokens - start, width]``. SeqStateError: no cell, or a
    block not fitting."""
    if n_tokens - start < 1 or start < 0:
        raise seqstate.SeqStateError(f"positions [{start}, {n_tokens}): need at least one cell")
    t = seqstate.ggml_type(layout.type_kv)
    dtype, width = np.dtype(t.dtype), layout.width
    itemsize, row = dtype.itemsize, layout.width * dtype.itemsize
    size = state_bytes(layout, n_tokens - start)
    # not zero-filled: every byte of the state is written below, so a new buffer's pages are
    # touched once, by the copies
    buf = out if out is not None and len(out) >= size else np.empty(size, np.uint8)
    _HEAD.pack_into(buf, 0, seqstate.SEQ_STATE_MAGIC, seq_id)
    cells = _cells(layout, start, n_tokens, tokens, seq_id)
    n = n_tokens - start
    at, views = 8, []
    for i, n_layer in enumerate(layout.part_layers):
        _PART.pack_into(buf, at, layout.n_stream, n)
        at += 8
        buf[at:at + cells.nbytes] = cells.reshape(-1).view(np.uint8)
        at += cells.nbytes
        _PART.pack_into(buf, at, layout.v_trans, n_layer)
        at += 8
        if not n_layer:  # an iSWA cache part without layers: cells only
            empty = np.empty((0, n, width), dtype)
            views.append((empty, empty))
            at = _empty_streams(buf, at, layout.n_stream - 1)
            continue
        stride = 12 + n * row  # one layer: its header, then its rows
        k = np.ndarray((n_layer, n, width), dtype, buf, at + 12, (stride, row, itemsize))
        for il in range(n_layer):
            _ROW.pack_into(buf, at + il * stride, t.code, row)
        at += n_layer * stride
        if layout.v_trans:
            v_t = np.ndarray((n_layer, width, n), dtype, buf, at + 12, (stride, n * itemsize, itemsize))
            v = v_t.transpose(0, 2, 1)
            for il in range(n_layer):
                _VT.pack_into(buf, at + il * stride, t.code, itemsize, width)
        else:
            v = np.ndarray((n_layer, n, width), dtype, buf, at + 12, (stride, row, itemsize))
            for il in range(n_layer):
                _ROW.pack_into(buf, at + il * stride, t.code, row)
        at += n_layer * stride
        _copy_blocks(blocks, layout.part_range(i), k, v, head_width, start)
        views.append((k, v))
        at = _empty_streams(buf, at, layout.n_stream - 1)
    if at != size:
        raise seqstate.SeqStateError(f"state buffer: wrote {at} of {size} bytes")
    return buf, views


def _empty_streams(buf: np.ndarray, at: int, n: int) -> int:
    """Write ``n`` empty streams (cell_count 0) at ``at``: llama.cpp restores the one stream with
    cells into the destination sequence's own stream, whichever it was. Returns the offset after."""
    buf[at:at + 4 * n] = 0
    return at + 4 * n


def _cells(layout: StateLayout, start: int, end: int, tokens: Sequence[int], seq_id: int) -> np.ndarray:
    """The cell records of positions start..end-1: pos, n_seq_id 1, [x, y, tok], seq_id (int32)."""
    ext = 3 if layout.cell_ext else 0
    cells = np.empty((end - start, 3 + ext), dtype="<i4")
    pos = np.arange(start, end, dtype=np.int64)
    cells[:, 0] = pos
    cells[:, 1] = 1
    if ext:
        cells[:, 2:5] = seqstate.text_cell_ext(pos, np.asarray(tokens[start:end]), layout.pos_2d)
    cells[:, -1] = seq_id
    return cells


def _copy_blocks(blocks: Sequence[KVBlock], part: range, k: np.ndarray, v: np.ndarray, head_width: int,
                 start: int = 0) -> None:
    """Copy the rows of ``blocks`` that fall in the part holding canonical layers ``part`` and in
    positions ``[start, start + n)`` into its views ``k``, ``v`` ``[part layers, n, width]``
    (``v`` may be a transposed view)."""
    end = start + k.shape[1]
    for b in blocks:
        lo, hi = _overlap(b.layers, part)
        a, z = max(b.start, start), min(b.end, end)
        if lo >= hi or a >= z:
            continue
        first = b.layers[lo] - part.start
        dst = slice(first, first + (hi - lo - 1) * b.layers.step + 1, b.layers.step)
        cols = slice(b.heads.start * head_width, b.heads.stop * head_width)
        if b.keys.shape[2] != cols.stop - cols.start or b.values.shape[2] != cols.stop - cols.start:
            raise seqstate.SeqStateError(f"block [{b.start}, {b.end}): rows of {b.keys.shape[2]} items, "
                                         f"heads {b.heads.start}..{b.heads.stop} need {cols.stop - cols.start}")
        k[dst, a - start:z - start, cols] = b.keys[lo:hi, a - b.start:z - b.start]
        v[dst, a - start:z - start, cols] = b.values[lo:hi, a - b.start:z - b.start]


def _overlap(layers: range, part: range) -> tuple[int, int]:
    """The indices ``[lo, hi)`` into ``layers`` of the layers that lie in ``part``."""
    step = layers.step
    lo = max(0, -(-(part.start - layers.start) // step))
    hi = min(len(layers), max(0, -(-(part.stop - layers.start) // step)))
    return lo, hi


def stage(layout: StateLayout, fragment: KVFragment) -> KVFragment:
    """``fragment`` itself, its ``values`` (when the state holds V transposed) a ``[layers,
    span, width]`` view of a C-contiguous ``[layers, width, span]`` array with the same values:
    one transposing copy when a RAM tier keeps it, not one per injection."""
    if layout.v_trans and fragment.values.flags.c_contiguous:
        fragment.values = np.ascontiguousarray(fragment.values.transpose(0, 2, 1)).transpose(0, 2, 1)
    return fragment
