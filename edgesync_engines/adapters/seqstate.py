"""llama.cpp per-sequence KV state bytes <-> numpy arrays, for any number of cache parts.

The byte layout is the one ``llama_state_seq_get_data`` / ``llama_state_seq_set_data`` (and
their ``_ext`` variants) use in llama-cpp-python 0.3.36, read from the vendored
``src/llama-kv-cache.cpp`` (``llama_kv_cache::state_write``, ``state_write_meta``,
``state_write_data`` and their ``state_read*`` counterparts), ``src/llama-kv-cache-iswa.cpp``
(a sliding-window model's cache writes its global part, then its sliding-window part) and
``src/llama-context.cpp`` (``state_seq_get_data`` writes ``io_magic`` and the seq id first).
Little-endian::

    magic 0xAF143CD8, seq_id                    u32, i32
    per cache part (one for most models, two for iSWA models: global then sliding window):
      n_stream                                  u32 (the context's streams: 1, or one per sequence
                                                with kv_unified off; a sequence's state fills one)
      per stream:
        cell_count                              u32 (0: the stream is empty, nothing follows)
        per cell: pos i32, n_seq_id u32, [ext x i32, y i32, tok i32: M-RoPE and PLE models], seq_id i32 x n_seq_id
        (only when cell_count > 0:)
        v_trans u32, n_layer u32
        per layer K: type i32, row_bytes u64, cell_count x row_bytes
        per layer V, v_trans == 0: type i32, row_bytes u64, cell_count x row_bytes
        per layer V, v_trans == 1: type i32, el_size u32, n_embd_v_gqa u32, n_embd_v_gqa x cell_count x el_size

A sliding-window part holds only the cells its window still needs: ``state_write`` skips cells
that ``llama_hparams::is_masked_swa`` masks for the sequence's highest position.

Arrays are in canonical order: per layer ``[n_cells, width]`` rows sorted by position, where a
row is ``width`` elements of f16/f32/bf16 (bf16 kept as raw ``<u2``), or for block-quantized
types (q8_0, q4_0, ...) ``width`` raw bytes: whole blocks, so a row can still be cut by token.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

SEQ_STATE_MAGIC = 0xAF143CD8
"""``io_magic`` in llama.cpp's ``src/llama-context.cpp``."""
MAX_STREAMS = 256
"""``LLAMA_MAX_SEQ`` (``src/llama-cparams.h``): a context's sequences, hence its KV streams, at most."""
CELL_EXT_BYTES = 12
"""``sizeof(llama_kv_cell_ext)`` (``src/llama-kv-cells.h``: x, y, tok as int32)."""


@dataclass(frozen=True)
class GgmlType:
    """A ggml tensor type as a KV row holds it: ``block`` elements take ``block_bytes`` bytes
    (ggml's ``type_traits`` in ``ggml/src/ggml.c``; block structs in ``ggml-common.h``)."""

    code: int
    name: str
    block: int
    block_bytes: int
    dtype: str
    """numpy dtype of a row's items: the element type, or ``uint8`` for quantized blocks."""

    @property
    def quantized(self) -> bool:
        """True for block-quantized types (rows are raw bytes)."""
        return self.block > 1


GGML_TYPES = {t.code: t for t in (
    GgmlType(0, "f32", 1, 4, "<f4"),
    GgmlType(1, "f16", 1, 2, "<f2"),
    GgmlType(2, "q4_0", 32, 18, "u1"),
    GgmlType(3, "q4_1", 32, 20, "u1"),
    GgmlType(6, "q5_0", 32, 22, "u1"),
    GgmlType(7, "q5_1", 32, 24, "u1"),
    GgmlType(8, "q8_0", 32, 34, "u1"),
    GgmlType(30, "bf16", 1, 2, "<u2"),
)}
"""The ggml types (``ggml.h`` codes) llama.cpp accepts as ``type_k``/``type_v``."""
GGML_TYPE_BY_NAME = {t.name: t for t in GGML_TYPES.values()}


class SeqStateError(ValueError):
    """Seq-state bytes that this codec does not understand or that do not fit the model."""


@dataclass
class CachePart:
    """One cache part of a single-stream sequence state: ``pos`` ``[n_cells]`` int64, ascending
    and consecutive; ``ext`` ``[n_cells, 3]`` int32 (x, y, tok) or None; ``k``, ``v`` one
    ``[n_cells, width]`` array per layer of ``ggml_type(type).dtype``; ``type_k``, ``type_v``
    ggml type codes; ``v_trans`` as llama.cpp wrote it (1 when flash attention is off);
    ``n_stream`` the context's KV streams (the cells are those of the one non-empty stream)."""

    pos: np.ndarray
    ext: np.ndarray | None
    k: list[np.ndarray]
    v: list[np.ndarray]
    type_k: int
    type_v: int
    v_trans: int
    n_stream: int = 1

    @property
    def n_layer(self) -> int:
        """Layers in this part."""
        return len(self.k)


def ggml_type(code: int) -> GgmlType:
    """The :class:`GgmlType` of a ggml type code; SeqStateError for a type llama.cpp does not use for KV."""
    t = GGML_TYPES.get(code)
    if t is None:
        raise SeqStateError(f"ggml type {code} is not a KV type this codec knows")
    return t


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

    def array(self, n_rows: int, row_bytes: int, t: GgmlType) -> np.ndarray:
        return np.frombuffer(self.raw(n_rows * row_bytes), dtype=t.dtype).reshape(n_rows, -1)


def _read_cells(r: _Reader, cell_count: int, ext_bytes: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Positions (and extensions) of the cells; fast path for one seq id per cell."""
    rec = 12 + ext_bytes
    if r.at + rec * cell_count <= len(r.view):
        block = np.frombuffer(r.view[r.at : r.at + rec * cell_count], dtype="<i4").reshape(cell_count, rec // 4)
        if np.all(block[:, 1] == 1):
            r.at += rec * cell_count
            ext = block[:, 2:5].astype(np.int32) if ext_bytes else None
            return block[:, 0].astype(np.int64), ext
    pos = np.empty(cell_count, dtype=np.int64)
    ext = np.empty((cell_count, 3), dtype=np.int32) if ext_bytes else None
    for i in range(cell_count):
        pos[i] = r.take("i")
        n_seq = r.take("I")
        if ext is not None:
            ext[i] = np.frombuffer(r.raw(ext_bytes), dtype="<i4")
        r.raw(4 * n_seq)
    return pos, ext


def _read_layers(r: _Reader, n_layer: int, cell_count: int, v_trans: int, part: int):
    k, v, types_k, types_v = [], [], set(), set()
    for il in range(n_layer):
        t = ggml_type(r.take("i"))
        row_bytes = r.take("Q")
        if row_bytes % t.block_bytes:
            raise SeqStateError(f"part {part} layer {il} K: row_bytes {row_bytes} is not whole {t.name} blocks")
        types_k.add(t.code)
        k.append(r.array(cell_count, row_bytes, t))
    for il in range(n_layer):
        t = ggml_type(r.take("i"))
        types_v.add(t.code)
        if v_trans:
            el_size, n_embd = r.take("I"), r.take("I")
            if t.quantized or el_size != t.block_bytes:
                raise SeqStateError(f"part {part} layer {il} V: a transposed {t.name} V (el_size {el_size}) is not cut")
            v.append(r.array(n_embd, cell_count * el_size, t).T)
        else:
            v.append(r.array(cell_count, r.take("Q"), t))
    if len(types_k) != 1 or len(types_v) != 1:
        raise SeqStateError(f"part {part}: K or V types differ between layers")
    return k, v, types_k.pop(), types_v.pop()


def _read_part(r: _Reader, n: int, cell_ext_bytes: int) -> CachePart:
    """Part ``n`` of a seq state, from the reader's position (layout: module docstring)."""
    n_stream = r.take("I")
    if not 1 <= n_stream <= MAX_STREAMS:
        raise SeqStateError(f"part {n} n_stream: {n_stream} is not in [1, {MAX_STREAMS}]")
    held = None
    for _ in range(n_stream):
        cell_count = r.take("I")
        if cell_count == 0:
            continue
        if held is not None:
            raise SeqStateError(f"part {n}: several streams hold cells of one sequence")
        pos, ext = _read_cells(r, cell_count, cell_ext_bytes)
        v_trans, n_layer = r.take("I"), r.take("I")
        # a part may hold cells but no layers (an iSWA cache whose model has no sliding layers)
        held = cell_count, pos, ext, v_trans, (
            _read_layers(r, n_layer, cell_count, v_trans, n) if n_layer else ([], [], 1, 1))
    if held is None:
        raise SeqStateError(f"part {n} cell_count: the sequence is empty")
    cell_count, pos, ext, v_trans, (k, v, type_k, type_v) = held
    order = np.argsort(pos, kind="stable")
    pos = pos[order]
    if not np.array_equal(pos, np.arange(pos[0], pos[0] + cell_count)):
        raise SeqStateError(f"part {n}: positions are not consecutive from {pos[0]}")
    if not np.array_equal(order, np.arange(cell_count)):
        k, v = [a[order] for a in k], [a[order] for a in v]
        ext = ext[order] if ext is not None else None
    return CachePart(pos, ext, k, v, type_k, type_v, v_trans, n_stream)


def parse_parts(data: bytes | memoryview, cell_ext_bytes: int = 0) -> list[CachePart]:
    """Parse one sequence's seq-state bytes into its cache parts, each in position order.
    ``cell_ext_bytes``: 0, or :data:`CELL_EXT_BYTES` for M-RoPE and PLE models. Raises SeqStateError
    for bad magic, truncation, cells in several streams, an empty part, unknown types, a transposed quantized
    V, or positions with gaps or repeats."""
    r = _Reader(data)
    magic = r.take("I")
    if magic != SEQ_STATE_MAGIC:
        raise SeqStateError(f"magic: 0x{magic:08X} is not llama.cpp's seq-state magic 0x{SEQ_STATE_MAGIC:08X}")
    r.take("i")  # the source seq_id
    parts = []
    while r.at < len(r.view):
        try:
            parts.append(_read_part(r, len(parts), cell_ext_bytes))
        except SeqStateError as exc:
            if not parts:
                raise
            raise SeqStateError(f"seq state has trailing bytes after {len(parts)} cache part(s) that are not "
                                f"another part ({exc})") from None
    if not parts:
        raise SeqStateError("seq state holds no cache part")
    if all(p.n_layer == 0 for p in parts):
        raise SeqStateError("n_layer: no part holds a layer")
    return parts


def text_cell_ext(pos: np.ndarray, tokens: np.ndarray, pos_2d: bool) -> np.ndarray:
    """The cell extensions llama.cpp gives text tokens (``llama_kv_cache::apply_ubatch``):
    ``[n, 3]`` int32 (x, y, tok), tok the token id, x = y = the position for M-RoPE models
    (``pos_2d``: a text token has the same position in every dimension) and 0 otherwise."""
    xy = np.asarray(pos) if pos_2d else np.zeros(len(pos), dtype=np.int64)
    return np.stack([xy, xy, np.asarray(tokens)], axis=1).astype(np.int32)
