"""llama.cpp per-sequence KV state bytes <-> numpy arrays.

The byte layout is the one ``llama_state_seq_get_data`` / ``llama_state_seq_set_data`` use in
llama-cpp-python 0.3.36, read from the vendored ``src/llama-kv-cache.cpp``
(``llama_kv_cache::state_write``, ``state_write_meta``, ``state_write_data`` and their
``state_read*`` counterparts) and ``src/llama-context.cpp`` (``state_seq_get_data`` writes
``io_magic`` and the seq id first; ``state_seq_set_data`` checks the magic). Little-endian::

    magic 0xAF143CD8, seq_id                    u32, i32
    n_stream                                    u32
    per stream:
      cell_count                                u32
      per cell: pos i32, n_seq_id u32, [ext: 12 bytes, M-RoPE/PLE models only], seq_id i32 x n_seq_id
      (only when cell_count > 0:)
      v_trans u32, n_layer u32
      per layer K: type i32, row_bytes u64, cell_count x row_bytes
      per layer V, v_trans == 0: type i32, row_bytes u64, cell_count x row_bytes
      per layer V, v_trans == 1: type i32, el_size u32, n_embd_v_gqa u32, n_embd_v_gqa x cell_count x el_size

Models with a two-part cache (gemma3's global + sliding window) write one such section per
part, back to back; :func:`parse` reads only single-part states and says so otherwise.

Arrays returned are in canonical order: ``k`` and ``v`` float ``[n_layer, n_tokens, width]``
(f16 for type 1, f32 for type 0), rows sorted by position 0..n_tokens-1.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

GGML_TYPE_DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2")}
"""ggml_type codes (ggml.h: GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1) whose rows are plain arrays."""
DTYPE_NAMES = {0: "f32", 1: "f16"}
SEQ_STATE_MAGIC = 0xAF143CD8
"""``io_magic`` in llama.cpp's ``src/llama-context.cpp``."""


class SeqStateError(ValueError):
    """Seq-state bytes that this codec does not understand or that do not fit the model."""


@dataclass
class SeqState:
    """A parsed single-stream, single-part sequence state.

    ``k``, ``v``: ``[n_layer, n_tokens, width]`` arrays of dtype f16 or f32, rows in position
    order; ``type_k``/``type_v`` are ggml type codes; ``v_trans`` as written by llama.cpp
    (1 when flash attention is off).
    """

    k: np.ndarray
    v: np.ndarray
    type_k: int
    type_v: int
    v_trans: int

    @property
    def n_tokens(self) -> int:
        """Positions held (0..n_tokens-1)."""
        return int(self.k.shape[1])

    @property
    def n_layer(self) -> int:
        """Layers held."""
        return int(self.k.shape[0])


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.view = memoryview(data)
        self.at = 0

    def take(self, fmt: str) -> int:
        st = struct.Struct("<" + fmt)
        if self.at + st.size > len(self.view):
            raise SeqStateError(f"seq state truncated at byte {self.at} (reading {fmt})")
        (value,) = st.unpack_from(self.view, self.at)
        self.at += st.size
        return value

    def raw(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.view):
            raise SeqStateError(f"seq state truncated at byte {self.at} (need {n} bytes)")
        out = self.view[self.at : self.at + n]
        self.at += n
        return out


def _read_cells(r: _Reader, cell_count: int, cell_ext_bytes: int) -> np.ndarray:
    """Positions of the cells; fast path for the common record (pos, n_seq_id=1, seq_id)."""
    if cell_ext_bytes == 0 and r.at + 12 * cell_count <= len(r.view):
        block = np.frombuffer(r.view[r.at : r.at + 12 * cell_count], dtype="<i4").reshape(cell_count, 3)
        if np.all(block[:, 1] == 1):
            r.at += 12 * cell_count
            return block[:, 0].astype(np.int64)
    pos = np.empty(cell_count, dtype=np.int64)
    for i in range(cell_count):
        pos[i] = r.take("i")
        n_seq = r.take("I")
        r.raw(cell_ext_bytes)
        r.raw(4 * n_seq)
    return pos


def parse(data: bytes | memoryview, cell_ext_bytes: int = 0) -> SeqState:
    """Parse ``llama_state_seq_get_data`` output of one sequence into position-ordered arrays.

    Args:
        data: the seq-state bytes.
        cell_ext_bytes: per-cell extension size (0 for llama-architecture models such as
            SmolLM2; 12 for M-RoPE models).

    Raises:
        SeqStateError: truncated or trailing bytes, several streams or cache parts, quantized
            K/V types, positions that are not exactly 0..n-1, or per-layer widths that differ.
    """
    r = _Reader(data)
    magic = r.take("I")
    if magic != SEQ_STATE_MAGIC:
        raise SeqStateError(f"magic: 0x{magic:08X} is not llama.cpp's seq-state magic 0x{SEQ_STATE_MAGIC:08X}")
    r.take("i")  # the source seq_id
    n_stream = r.take("I")
    if n_stream != 1:
        raise SeqStateError(f"n_stream: {n_stream} streams; only a single stream is supported")
    cell_count = r.take("I")
    if cell_count == 0:
        raise SeqStateError("cell_count: the sequence is empty")
    pos = _read_cells(r, cell_count, cell_ext_bytes)
    v_trans = r.take("I")
    n_layer = r.take("I")
    if n_layer == 0:
        raise SeqStateError("n_layer: 0 layers")
    k_layers, v_layers, type_k, type_v = [], [], None, None
    for il in range(n_layer):
        t = r.take("i")
        row_bytes = r.take("Q")
        dtype = GGML_TYPE_DTYPES.get(t)
        if dtype is None:
            raise SeqStateError(f"layer {il} K: ggml type {t} is not f16/f32 (quantized KV is not supported)")
        if row_bytes % dtype.itemsize:
            raise SeqStateError(f"layer {il} K: row_bytes {row_bytes} is not a multiple of {dtype.itemsize}")
        type_k = t if type_k is None else type_k
        k_layers.append(np.frombuffer(r.raw(cell_count * row_bytes), dtype=dtype).reshape(cell_count, -1))
    for il in range(n_layer):
        t = r.take("i")
        dtype = GGML_TYPE_DTYPES.get(t)
        if dtype is None:
            raise SeqStateError(f"layer {il} V: ggml type {t} is not f16/f32 (quantized KV is not supported)")
        type_v = t if type_v is None else type_v
        if v_trans:
            el_size = r.take("I")
            n_embd = r.take("I")
            if el_size != dtype.itemsize:
                raise SeqStateError(f"layer {il} V: el_size {el_size} disagrees with type {t}")
            rows = np.frombuffer(r.raw(n_embd * cell_count * el_size), dtype=dtype).reshape(n_embd, cell_count)
            v_layers.append(rows.T)
        else:
            row_bytes = r.take("Q")
            v_layers.append(np.frombuffer(r.raw(cell_count * row_bytes), dtype=dtype).reshape(cell_count, -1))
    if r.at != len(r.view):
        raise SeqStateError(
            f"seq state has {len(r.view) - r.at} trailing bytes: a multi-part cache (e.g. gemma3 sliding window) "
            "is not supported"
        )
    if len({a.shape[1] for a in k_layers}) != 1 or len({a.shape[1] for a in v_layers}) != 1:
        raise SeqStateError("per-layer K or V widths differ; only uniform layers are supported")
    order = np.argsort(pos, kind="stable")
    if not np.array_equal(pos[order], np.arange(cell_count)):
        raise SeqStateError(f"positions are not exactly 0..{cell_count - 1}")
    k = np.stack(k_layers)[:, order].astype(GGML_TYPE_DTYPES[type_k].newbyteorder("="), copy=False)
    v = np.stack(v_layers)[:, order].astype(GGML_TYPE_DTYPES[type_v].newbyteorder("="), copy=False)
    return SeqState(np.ascontiguousarray(k), np.ascontiguousarray(v), type_k, type_v, v_trans)


def serialize(k: np.ndarray, v: np.ndarray, type_k: int, type_v: int, v_trans: int, seq_id: int = 0) -> bytearray:
    """Build ``llama_state_seq_set_data`` bytes for positions 0..n-1 of one sequence.

    Writes straight into one preallocated buffer (no intermediate copies); the result is a
    writable ``bytearray`` so that ctypes can hand it to llama.cpp without another copy.

    Args:
        k, v: ``[n_layer, n_tokens, width]`` arrays, dtype matching ``type_k``/``type_v``.
        type_k, type_v: ggml type codes (0 f32, 1 f16), as the destination context uses.
        v_trans: 1 when the destination context stores V transposed (flash attention off).
        seq_id: the sequence id written in the header and in each cell (llama.cpp ignores it
            on read and uses the destination sequence).

    Raises:
        SeqStateError: shapes or dtypes that disagree.
    """
    if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2]:
        raise SeqStateError(
            f"k {k.shape} and v {v.shape} must be [n_layer, n_tokens, width] with equal n_layer, n_tokens"
        )
    n_layer, n_tokens, width_k = k.shape
    width_v = v.shape[2]
    dk, dv = GGML_TYPE_DTYPES.get(type_k), GGML_TYPE_DTYPES.get(type_v)
    if dk is None or dv is None:
        raise SeqStateError(f"types {type_k}/{type_v}: only f16 (1) and f32 (0) are supported")
    k_bytes = n_tokens * width_k * dk.itemsize
    v_bytes = n_tokens * width_v * dv.itemsize
    total = 16 + 12 * n_tokens + 8 + n_layer * (12 + k_bytes) + n_layer * (12 + v_bytes)
    buf = bytearray(total)
    struct.pack_into("<IiII", buf, 0, SEQ_STATE_MAGIC, seq_id, 1, n_tokens)
    cells = np.frombuffer(buf, dtype="<i4", count=3 * n_tokens, offset=16).reshape(n_tokens, 3)
    cells[:, 0] = np.arange(n_tokens)
    cells[:, 1] = 1
    cells[:, 2] = seq_id
    at = 16 + 12 * n_tokens
    struct.pack_into("<II", buf, at, int(v_trans), n_layer)
    at += 8
    for il in range(n_layer):
        struct.pack_into("<iQ", buf, at, type_k, width_k * dk.itemsize)
        at += 12
        np.frombuffer(buf, dtype=dk, count=n_tokens * width_k, offset=at).reshape(n_tokens, width_k)[:] = k[il]
        at += k_bytes
    for il in range(n_layer):
        if v_trans:
            struct.pack_into("<iII", buf, at, type_v, dv.itemsize, width_v)
            at += 12
            np.frombuffer(buf, dtype=dv, count=n_tokens * width_v, offset=at).reshape(width_v, n_tokens)[:] = v[il].T
        else:
            struct.pack_into("<iQ", buf, at, type_v, width_v * dv.itemsize)
            at += 12
            np.frombuffer(buf, dtype=dv, count=n_tokens * width_v, offset=at).reshape(n_tokens, width_v)[:] = v[il]
        at += v_bytes
    assert at == total
    return buf
