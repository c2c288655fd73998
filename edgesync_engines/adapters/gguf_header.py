"""The header of a GGUF file (metadata and tensor directory) read without loading the model.

GGUF layout (ggml's ``docs/gguf.md``): magic ``b"GGUF"``, version u32, tensor count u64,
metadata count u64, the key/value pairs (key: u64 length + UTF-8; value: type u32 + payload,
arrays as element type u32 + count u64 + elements), then per tensor: name, n_dims u32, dims u64
x n_dims, ggml type u32, offset u64 (from the data section, which starts at the next multiple
of ``general.alignment``). Big-endian files are recognised as ggml's reader does.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_ARRAY_ITEMS = 256
"""Arrays up to this many elements are kept in :attr:`GGUFHeader.metadata`; longer ones only
by length in :attr:`GGUFHeader.array_lengths`."""
DEFAULT_ALIGNMENT = 32
"""``general.alignment`` when the file does not say (ggml's ``GGUF_DEFAULT_ALIGNMENT``)."""
VALUE_STRING, VALUE_ARRAY = 8, 9
"""GGUF value types of a string and an array (``enum gguf_type`` in ggml's ``gguf.h``)."""
VALUE_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF scalar value type -> ``struct`` format (``enum gguf_type``, ggml's ``gguf.h``)."""
GGML_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
    22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
    29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}
"""ggml type number -> (elements per block, bytes per block): gguf-py's ``GGML_QUANT_SIZES``
(``tests/test_gguf_header.py`` compares them)."""


class GGUFHeaderError(ValueError):
    """Not a GGUF, or a truncated or malformed header; the message names the file and where."""


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_header` found.

    Attributes:
        version: GGUF version (2 or 3).
        metadata: key -> value (int, float, bool, str, or a list for short arrays).
        array_lengths: key -> element count, for every array (kept or not).
        tensors: tensor name -> (shape in ggml order, ggml type number, bytes).
        data_end: bytes the tensor data needs from the start of the file (the last tensor's
            offset + size, after the aligned header); a complete file is at least this long.
        file_size: the file's size in bytes.
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, tuple[tuple[int, ...], int, int]] = field(default_factory=dict)
    data_end: int = 0
    file_size: int = 0

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (e.g. ``"llama"``, ``"gemma3"``), None when missing."""
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) and arch else None

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        """The value of ``<architecture>.<suffix>`` (e.g. ``attention.sliding_window``)."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)


class _Cursor:
    """Little- or big-endian reads from a memory map, with bounds checks."""

    def __init__(self, buf, path: Path, endian: str = "<") -> None:
        self.buf, self.path, self.endian, self.pos = buf, path, endian, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFHeaderError(f"{self.path}: not a readable GGUF: truncated at byte {self.pos} "
                                  f"of {len(self.buf)} (the header ends early)")
        (value,) = struct.unpack_from(self.endian + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise GGUFHeaderError(f"{self.path}: not a readable GGUF: a {n}-byte string at byte {self.pos} "
                                  f"runs past the end ({len(self.buf)} bytes)")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return text

    def skip_strings(self, count: int) -> None:
        buf, pos, fmt, end = self.buf, self.pos, self.endian + "Q", len(self.buf)
        for _ in range(count):
            if pos + 8 > end:
                break
            pos += 8 + struct.unpack_from(fmt, buf, pos)[0]
        else:
            if pos <= end:
                self.pos = pos
                return
        raise GGUFHeaderError(f"{self.path}: not a readable GGUF: a string array runs past the end "
                              f"({end} bytes)")


def _value(cur: _Cursor, vtype: int, formats: dict[int, str], key: str, lengths: dict[str, int]) -> Any:
    if vtype in formats:
        return cur.unpack(formats[vtype])
    if vtype == VALUE_STRING:
        return cur.string()
    if vtype != VALUE_ARRAY:
        raise GGUFHeaderError(f"{cur.path}: not a readable GGUF: {key!r} has unknown value type {vtype}")
    etype, count = cur.unpack("I"), cur.unpack("Q")
    lengths[key] = count
    if count <= MAX_ARRAY_ITEMS:
        return [_value(cur, etype, formats, key, {}) for _ in range(count)]
    if etype == VALUE_STRING:
        cur.skip_strings(count)
    elif etype in formats:
        cur.pos += count * struct.calcsize(formats[etype])
    else:
        raise GGUFHeaderError(f"{cur.path}: not a readable GGUF: {key!r} is an array of type {etype}")
    return None


def _tensor_bytes(path: Path, name: str, shape: tuple[int, ...], gtype: int) -> int:
    if gtype not in GGML_BLOCKS:
        raise GGUFHeaderError(f"{path}: tensor {name!r} has ggml type {gtype}, which this reader does not know")
    block, size = GGML_BLOCKS[gtype]
    n = 1
    for d in shape:
        n *= int(d)
    return n // block * size


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Read a GGUF's metadata and tensor directory (not the weights). Raises FileNotFoundError, or
    GGUFHeaderError for no GGUF magic, version 1, or a truncated or malformed header."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise GGUFHeaderError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
        if size < 24:
            raise GGUFHeaderError(f"{path}: not a readable GGUF: {size} bytes, less than a GGUF header")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path, size)


def _parse(buf, path: Path, size: int) -> GGUFHeader:
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.unpack("I")
    if version & 0xFFFF == 0:  # written big-endian
        cur.endian, cur.pos = ">", 4
        version = cur.unpack("I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"{path}: GGUF version {version}; only versions 2 and 3 are read")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    if n_tensors > size or n_kv > size:
        raise GGUFHeaderError(f"{path}: not a readable GGUF: {n_tensors} tensors and {n_kv} keys in {size} bytes")
    formats, metadata, lengths = VALUE_FORMATS, {}, {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = _value(cur, cur.unpack("I"), formats, key, lengths)
    metadata = {k: v for k, v in metadata.items() if v is not None or k not in lengths}
    tensors, end = {}, 0
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        if n_dims > 8:
            raise GGUFHeaderError(f"{path}: not a readable GGUF: tensor {name!r} has {n_dims} dimensions")
        shape = tuple(cur.unpack("Q") for _ in range(n_dims))
        gtype, offset = cur.unpack("I"), cur.unpack("Q")
        nbytes = _tensor_bytes(path, name, shape, gtype)
        tensors[name] = (shape, gtype, nbytes)
        end = max(end, offset + nbytes)
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    align = align if isinstance(align, int) and align > 0 else DEFAULT_ALIGNMENT
    start = -(-cur.pos // align) * align
    return GGUFHeader(path, version, metadata, lengths, tensors, start + end if tensors else cur.pos, size)


def not_a_model(h: GGUFHeader) -> str | None:
    """Why the GGUF of header ``h`` is not a loadable language model (one line, without the
    file name), or None."""
    kind = h.metadata.get("general.type")
    if isinstance(kind, str) and kind != "model":
        return f"a GGUF of type {kind!r}, not a model"
    if h.architecture is None:
        return "no general.architecture: not a model GGUF"
    if not h.tensors:
        return f"{h.architecture} GGUF with no tensors (a vocabulary-only file?), not a model"
    if "token_embd.weight" not in h.tensors:
        return f"{h.architecture} GGUF without token_embd.weight: not a language model"
    if h.data_end > h.file_size:
        return f"truncated: its tensors need {h.data_end} bytes, the file has {h.file_size}"
    return None
