"""Tests for edgesync_store.core.codec: round trips in both compressions and both V orders,
in-place decoding, the head, format-1 blobs, and refusal of corrupt or crafted blobs.

No mocks. Corrupt blobs are made by flipping bytes of a real encoded blob (a fake for a corrupt
page on disk); crafted blobs are re-built with the layout of codec.py's docstring by an
independent helper here (its own struct and xxhash code, none of codec's functions) that
recomputes both xxh3 checksums and the padding, so that only the field under test is wrong.
Format-1 blobs are written by ``tests/format1.py``'s own encoder.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import tracemalloc
from dataclasses import dataclass, replace

import numpy as np
import pytest
import xxhash
import zstandard
from format1 import encode_v1, v1_head_nbytes
from fragments import SMOL  # noqa: E402  (tests/fragments.py)

from edgesync_store.core import codec
from edgesync_store.core.codec import CodecError, decode, encode, head_of, peek
from edgesync_store.schema import EMBEDDING_DIM, KVFragment, Namespace, content_hash, prefix_hash

SMOL_F32 = replace(SMOL, kv_dtype="f32")
COMPRESSIONS = ["none", "zstd"]


def make_fragment(
    ns: Namespace = SMOL,
    token_start: int = 0,
    span: int = 64,
    layers: tuple[int, int, int] = (0, 30, 1),
    heads: tuple[int, int] = (0, 3),
    seed: int = 0,
    kind: str = "normal",
    embedding: bool = False,
) -> KVFragment:
    """A valid fragment with seeded random K/V.

    kind "normal": N(0, 1) K and V, like real activations; "bits": uniformly random bit
    patterns (every f16/f32 value including NaN payloads, infinities and subnormals);
    "smooth": slowly varying sinusoids (structured, compressible).
    """
    rng = np.random.default_rng(seed)
    n_layers = len(range(*layers))
    shape = (n_layers, span, (heads[1] - heads[0]) * ns.head_width)
    dtype = ns.np_dtype
    if kind == "bits":
        int_type = {1: np.uint8, 2: np.uint16, 4: np.uint32}[dtype.itemsize]
        k = rng.integers(0, np.iinfo(int_type).max, size=shape, dtype=int_type, endpoint=True).view(dtype)
        v = rng.integers(0, np.iinfo(int_type).max, size=shape, dtype=int_type, endpoint=True).view(dtype)
    elif kind == "smooth":
        t = np.arange(span)[None, :, None]
        c = np.arange(shape[2])[None, None, :]
        layer = np.arange(n_layers)[:, None, None]
        k = (np.sin(0.01 * t * (1 + c % 7) + layer) * (1 + c % 5)).astype(dtype)
        v = (np.cos(0.02 * t + 0.1 * c) * 0.5 + 0.01 * layer).astype(dtype)
    else:
        k = rng.standard_normal(shape).astype(dtype)
        v = (rng.standard_normal(shape) * 0.3).astype(dtype)
    all_ids = rng.integers(0, 49152, size=token_start + span, dtype=np.int32)
    return KVFragment(
        namespace=ns,
        token_start=token_start,
        token_end=token_start + span,
        layer_start=layers[0],
        layer_end=layers[1],
        layer_stride=layers[2],
        head_start=heads[0],
        head_end=heads[1],
        keys=k,
        values=v,
        token_ids=all_ids[token_start:],
        prefix_hash=prefix_hash(all_ids[:token_start]),
        embedding=rng.standard_normal(EMBEDDING_DIM).astype(np.float32) if embedding else np.zeros(0, np.float32),
        created_at=1_700_000_000.123456 + seed,
        expires_at=1_700_001_800.654321 + seed,
    )


def channel(frag: KVFragment) -> KVFragment:
    """``frag`` with V as an engine stages it: a ``[layers, span, width]`` transposed view of a
    C-contiguous ``[layers, width, span]`` array holding the same values."""
    out = replace(frag, values=np.ascontiguousarray(frag.values.transpose(0, 2, 1)).transpose(0, 2, 1))
    assert not out.values.flags.c_contiguous and out.values.transpose(0, 2, 1).flags.c_contiguous
    return out


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bit patterns of an array (compares NaNs bit-exactly)."""
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_fragment(a: KVFragment, b: KVFragment) -> None:
    for name in (
        "token_start", "token_end", "layer_start", "layer_end", "layer_stride", "head_start",
        "head_end", "prefix_hash", "content_hash", "created_at", "expires_at",
    ):
        assert getattr(a, name) == getattr(b, name), name
    assert a.namespace == b.namespace
    assert a.keys.dtype == b.keys.dtype == a.namespace.np_dtype
    assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
    assert np.array_equal(bits(a.keys), bits(b.keys))
    assert np.array_equal(bits(a.values), bits(b.values))
    assert a.token_ids.dtype == b.token_ids.dtype == np.int32
    assert np.array_equal(a.token_ids, b.token_ids)
    assert a.embedding.dtype == b.embedding.dtype == np.float32
    assert np.array_equal(a.embedding.view(np.uint32), b.embedding.view(np.uint32))
    assert a.key() == b.key()


def assert_same_header(a: codec.FragmentHeader, b: codec.FragmentHeader) -> None:
    for f in dataclasses.fields(codec.FragmentHeader):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def planes(arr: np.ndarray) -> bytes:
    """Byte planes of ``arr`` in C order (all byte 0s of its little-endian elements, then all byte 1s...)."""
    item = arr.dtype.itemsize
    raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).view(np.uint8).reshape(-1, item)
    return b"".join(raw[:, i].tobytes() for i in range(item))


def address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


# ---------------------------------------------------------------------------------------------
# independent parser of the documented layout (format 2)

PREFIX = struct.Struct("<4sHI")
SUM = struct.Struct("<Q")
ALIGN = 64


def xxh3(data) -> int:
    return xxhash.xxh3_64_intdigest(bytes(data))


@dataclass
class Parsed:
    version: int
    header: dict
    ids: bytes
    emb: bytes
    head_sum: int
    head_nbytes: int
    payload_at: int
    payload: bytes
    payload_sum: int


def parse_blob(blob: bytes) -> Parsed:
    """A format-2 blob's fields, every checksum and the zero padding verified here."""
    blob = bytes(blob)
    magic, version, header_len = PREFIX.unpack_from(blob, 0)
    assert (magic, version) == (b"ESKV", 2)
    header = json.loads(blob[10 : 10 + header_len])
    span = header["token_end"] - header["token_start"]
    at = 10 + header_len
    ids = blob[at : at + 4 * span]
    at += 4 * span
    emb = blob[at : at + 4 * header["embedding_dim"]]
    at += 4 * header["embedding_dim"]
    (head_sum,) = SUM.unpack_from(blob, at)
    assert head_sum == xxh3(blob[:at])
    head_nbytes = at + SUM.size
    payload_at = -(-head_nbytes // ALIGN) * ALIGN
    assert blob[head_nbytes:payload_at] == bytes(payload_at - head_nbytes)
    end = payload_at + header["payload_nbytes"]
    payload = blob[payload_at:end]
    (payload_sum,) = SUM.unpack_from(blob, end)
    assert payload_sum == xxh3(payload)
    assert end + SUM.size == len(blob)
    return Parsed(version, header, ids, emb, head_sum, head_nbytes, payload_at, payload, payload_sum)


def build_blob(p: Parsed, magic: bytes = b"ESKV") -> bytes:
    """Re-assemble a blob with valid xxh3 checksums and padding over whatever the fields now hold."""
    header_bytes = json.dumps(p.header, separators=(",", ":")).encode()
    head = PREFIX.pack(magic, p.version, len(header_bytes)) + header_bytes + p.ids + p.emb
    head += SUM.pack(xxh3(head))
    return head + bytes(-len(head) % ALIGN) + p.payload + SUM.pack(xxh3(p.payload))


def section_offsets(blob: bytes) -> dict[str, tuple[int, int]]:
    (header_len,) = struct.unpack_from("<I", blob, 6)
    p = parse_blob(blob)
    ids_at = 10 + header_len
    emb_at = ids_at + len(p.ids)
    sum_at = emb_at + len(p.emb)
    return {
        "prefix": (0, 10),
        "header": (10, ids_at),
        "token_ids": (ids_at, emb_at),
        "embedding": (emb_at, sum_at),
        "head_sum": (sum_at, p.head_nbytes),
        "padding": (p.head_nbytes, p.payload_at),
        "payload": (p.payload_at, p.payload_at + len(p.payload)),
        "payload_sum": (len(blob) - SUM.size, len(blob)),
    }


@pytest.fixture(scope="module")
def small_fragment() -> KVFragment:
    return make_fragment(layers=(0, 2, 1), embedding=True, seed=3, token_start=64)


@pytest.fixture(scope="module", params=COMPRESSIONS)
def small_blob(request, small_fragment) -> bytes:
    return encode(small_fragment, request.param)


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("v_order", ["token", "channel"])
@pytest.mark.parametrize(
    "ns, kwargs",
    [
        (SMOL, dict()),
        (SMOL, dict(kind="bits", token_start=128, span=100)),
        (SMOL, dict(layers=(0, 30, 3), heads=(1, 3), kind="bits", embedding=True)),
        (SMOL, dict(layers=(7, 8, 1), heads=(2, 3), span=2048, token_start=4096)),
        (SMOL_F32, dict(layers=(1, 29, 7), kind="bits", embedding=True)),
        (SMOL_F32, dict(layers=(0, 30, 1), heads=(0, 1), span=77, token_start=9)),
        (replace(SMOL, flash_attn=True), dict(kind="smooth", seed=9)),
        (replace(SMOL, kv_dtype="q8_0"), dict(kind="bits", layers=(0, 30, 5), span=96)),
        (replace(SMOL, kv_dtype="bf16"), dict(kind="bits", heads=(2, 3))),
    ],
    ids=["f16", "f16-bits", "f16-stride-heads-emb", "f16-maxspan", "f32-stride-bits", "f32-head", "fa-smooth",
         "q8_0-bits", "bf16-bits"],
)
def test_round_trip_bit_exact(ns, kwargs, v_order, compression):
    frag = make_fragment(ns, **kwargs)
    if v_order == "channel":
        frag = channel(frag)  # V given as a transposed view is written "channel"
    blob = encode(frag, compression)
    p = parse_blob(blob)
    assert (p.header["compression"], p.header["v_order"]) == (compression, v_order)
    back = decode(blob)
    assert_same_fragment(frag, back)
    # V comes back in the order it was stored: C-contiguous, or the transposed view
    assert back.keys.flags.c_contiguous
    assert (back.values.transpose(0, 2, 1) if v_order == "channel" else back.values).flags.c_contiguous
    # decode (copy=True) does not depend on the caller keeping the blob
    buf = np.frombuffer(blob, dtype=np.uint8)
    assert not np.shares_memory(back.keys, buf) and not np.shares_memory(back.values, buf)
    # decoding from a memoryview (the zero-copy LMDB buffer case) gives the same fragment
    assert_same_fragment(frag, decode(memoryview(blob)))
    # the encoding is deterministic, V's order included
    assert encode(back, compression) == blob
    # lifecycle counters are not part of the blob
    assert back.hit_count == 0 and back.last_hit_at == 0.0


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("v_order", ["token", "channel"])
def test_payload_is_k_then_v_as_documented(small_fragment, compression, v_order):
    frag = channel(small_fragment) if v_order == "channel" else small_fragment
    k = np.ascontiguousarray(frag.keys)
    v = np.ascontiguousarray(frag.values.transpose(0, 2, 1) if v_order == "channel" else frag.values)
    p = parse_blob(encode(frag, compression))
    assert p.header["raw_nbytes"] == k.nbytes + v.nbytes == frag.raw_nbytes
    assert p.header["shape"] == list(frag.keys.shape)
    if compression == "none":
        assert p.payload == k.astype("<f2").tobytes() + v.astype("<f2").tobytes()
        assert p.header["payload_nbytes"] == frag.raw_nbytes
    else:
        assert zstandard.frame_content_size(p.payload) == frag.raw_nbytes
        assert zstandard.ZstdDecompressor().decompress(p.payload) == planes(k) + planes(v)
        assert p.header["payload_nbytes"] == len(p.payload)
    # the token and channel blobs differ in V's bytes only, not in K's
    other = parse_blob(encode(channel(small_fragment) if v_order == "token" else small_fragment, "none"))
    if compression == "none":
        assert other.payload[:k.nbytes] == p.payload[:k.nbytes] and other.payload[k.nbytes:] != p.payload[k.nbytes:]


def test_encode_refuses_an_unknown_compression(small_fragment):
    with pytest.raises(ValueError, match="compression"):
        encode(small_fragment, "lz4")
    assert parse_blob(encode(small_fragment)).header["compression"] == "none"  # the default


def test_peek_reads_header_without_tensors(small_fragment, small_blob):
    head = peek(small_blob)
    p = parse_blob(small_blob)
    assert head.namespace == SMOL
    assert (head.token_start, head.token_end) == (64, 128)
    assert list(head.layers) == [0, 1]
    assert (head.head_start, head.head_end) == (0, 3)
    assert head.prefix_hash == small_fragment.prefix_hash
    assert head.content_hash == small_fragment.content_hash
    assert np.array_equal(head.token_ids, small_fragment.token_ids)
    assert head.shape == (2, 64, 192)
    assert head.raw_nbytes == small_fragment.raw_nbytes == 2 * 2 * 64 * 192 * 2
    assert head.payload_nbytes == len(p.payload)
    assert (head.compression, head.v_order, head.version) == (p.header["compression"], "token", 2)
    assert (head.head_nbytes, head.payload_at, head.blob_nbytes) == (p.head_nbytes, p.payload_at, len(small_blob))
    # peek works when the payload is garbage: it does not look at the tensors
    p.payload = b"\0" * len(p.payload)
    assert peek(build_blob(p)).content_hash == small_fragment.content_hash


def test_head_of_is_the_blobs_prefix_and_peeks_like_the_blob(small_blob):
    head = head_of(small_blob)
    p = parse_blob(small_blob)
    assert head == small_blob[:p.head_nbytes] and small_blob.startswith(head)
    assert head_of(memoryview(small_blob)) == head
    assert_same_header(peek(head), peek(small_blob))
    assert peek(head).payload_at == p.payload_at >= len(head)
    # the head alone is checked like a blob's
    corrupt = bytearray(head)
    corrupt[len(head) - 20] ^= 0x04  # fake for a corrupt page: a token ID's byte
    with pytest.raises(CodecError, match="head checksum"):
        peek(bytes(corrupt))
    with pytest.raises(CodecError, match="truncated"):
        peek(head[:-1])
    # a head is not a blob, nor is a blob with a byte too many
    with pytest.raises(CodecError, match="payload_nbytes"):
        head_of(head)
    with pytest.raises(CodecError, match="payload_nbytes"):
        head_of(small_blob + b"\0")
    with pytest.raises(CodecError):
        decode(head)


def test_payload_starts_at_a_multiple_of_64():
    paddings = set()
    for i, (ns, kwargs) in enumerate([
        (SMOL, dict()),
        (SMOL, dict(embedding=True, token_start=64)),
        (SMOL, dict(span=65, token_start=1)),
        (SMOL, dict(span=66, token_start=12345)),
        (SMOL, dict(span=67, layers=(3, 30, 9))),
        (SMOL_F32, dict(span=99, heads=(1, 2))),
        (replace(SMOL, layout="a longer layout name"), dict(span=70)),
    ]):
        frag = make_fragment(ns, seed=i, **kwargs)
        for compression in COMPRESSIONS:
            blob = encode(frag, compression)
            p = parse_blob(blob)
            assert p.payload_at % ALIGN == 0 and 0 <= p.payload_at - p.head_nbytes < ALIGN
            head = peek(blob)
            assert (head.head_nbytes, head.payload_at) == (p.head_nbytes, p.payload_at)
            paddings.add(p.payload_at - p.head_nbytes)
    assert len(paddings) > 3  # the heads end at several offsets: the padding is really computed
    # in place, from a 64-byte aligned buffer, K starts 64-byte aligned
    frag = make_fragment(span=65)
    blob = encode(frag)
    store = np.zeros(len(blob) + ALIGN, dtype=np.uint8)
    at = -address(store) % ALIGN
    store[at : at + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    aligned = memoryview(store[at : at + len(blob)]).toreadonly()
    view = decode(aligned, copy=False)
    assert address(view.keys) % ALIGN == 0
    assert_same_fragment(frag, view)


@pytest.mark.parametrize("v_order", ["token", "channel"])
def test_decode_without_copy_returns_read_only_views_of_the_blob(small_fragment, v_order):
    frag = channel(small_fragment) if v_order == "channel" else small_fragment
    blob = encode(frag, "none")
    buf = np.frombuffer(blob, dtype=np.uint8)
    p = parse_blob(blob)
    for source in (blob, memoryview(blob)):  # bytes, and the LMDB buffer case
        view = decode(source, copy=False)
        assert_same_fragment(frag, view)
        for arr in (view.keys, view.values):
            assert np.shares_memory(arr, buf)
            assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view.keys[0, 0, 0] = 0
        # K is the payload's first bytes, V (in its stored order) right after
        assert address(view.keys) == address(buf) + p.payload_at
        v_start = view.values.transpose(0, 2, 1) if v_order == "channel" else view.values
        assert v_start.flags.c_contiguous and address(v_start) == address(buf) + p.payload_at + frag.keys.nbytes
    for copied in (decode(blob, copy=True), decode(blob)):  # copy=True is the default
        assert_same_fragment(frag, copied)
        assert not np.shares_memory(copied.keys, buf) and not np.shares_memory(copied.values, buf)
        assert copied.keys.flags.writeable


def test_compressed_payload_decodes_into_arrays_of_its_own_even_without_copy(small_fragment):
    blob = encode(small_fragment, "zstd")
    buf = np.frombuffer(blob, dtype=np.uint8)
    back = decode(blob, copy=False)
    assert_same_fragment(small_fragment, back)
    assert not np.shares_memory(back.keys, buf) and not np.shares_memory(back.values, buf)


def test_compression_beats_raw_on_structured_data():
    frag = make_fragment(kind="smooth", span=256)
    blob = encode(frag, "zstd")
    assert len(blob) < 0.5 * frag.raw_nbytes, (len(blob), frag.raw_nbytes)
    p = parse_blob(blob)
    assert p.header["compression"] == "zstd"
    assert zstandard.frame_content_size(p.payload) == frag.raw_nbytes
    assert_same_fragment(frag, decode(blob))
    # uncompressed, the same fragment's payload is exactly its raw K and V
    plain = encode(frag, "none")
    assert len(plain) == parse_blob(plain).payload_at + frag.raw_nbytes + SUM.size


def test_random_normal_kv_compresses_at_least_a_little():
    # activation-like N(0,1) f16: the byte-shuffled exponent plane compresses
    frag = make_fragment(kind="normal", span=256, seed=11)
    assert len(encode(frag, "zstd")) < frag.raw_nbytes < len(encode(frag, "none"))


# ---------------------------------------------------------------------------------------------
# corruption (byte flips are fakes for a corrupt page on disk)


def _flip_positions(blob: bytes) -> list[int]:
    """Positions to flip in every section (the padding is covered by no checksum, but decode
    refuses a padding that is not zero)."""
    positions: set[int] = set()
    for name, (lo, hi) in section_offsets(blob).items():
        if name == "payload":
            rng = np.random.default_rng(0)
            positions.update(int(x) for x in rng.integers(lo, hi, size=300))
            positions.update((lo, lo + 1, lo + 5, hi - 1))
        elif name in ("header", "token_ids", "embedding"):
            positions.update(range(lo, hi, 3))
            positions.update((lo, hi - 1))
        else:
            positions.update(range(lo, hi))
    return sorted(positions)


def test_any_flipped_byte_is_refused(small_blob):
    positions = _flip_positions(small_blob)
    for name, (lo, hi) in section_offsets(small_blob).items():  # every section is sampled
        assert lo == hi or any(lo <= p < hi for p in positions), name
    for pos in positions:
        for mask in (0x01, 0x80, 0xFF):
            corrupt = bytearray(small_blob)
            corrupt[pos] ^= mask  # fake for a corrupt page: one byte changed on disk
            with pytest.raises(CodecError):
                decode(bytes(corrupt))


def test_flip_messages_name_the_failing_check(small_blob):
    offsets = section_offsets(small_blob)
    cases = {
        0: "magic",
        4: "version",
        5: "version",
        offsets["token_ids"][0] + 1: "head checksum",
        offsets["embedding"][0] + 2: "head checksum",
        offsets["head_sum"][0]: "head checksum",
        offsets["head_sum"][1] - 1: "head checksum",
        offsets["payload"][0]: "payload checksum",
        offsets["payload"][0] + 100: "payload checksum",
        offsets["payload"][1] - 1: "payload checksum",
        len(small_blob) - 1: "payload checksum",
    }
    for pos, expected in cases.items():
        corrupt = bytearray(small_blob)
        corrupt[pos] ^= 0x10  # fake for a corrupt page
        with pytest.raises(CodecError, match=expected):
            decode(bytes(corrupt))
        if expected in ("magic", "version", "head checksum"):
            with pytest.raises(CodecError, match=expected):
                peek(bytes(corrupt))


def test_truncated_blob_is_refused(small_blob):
    offsets = section_offsets(small_blob)
    cuts = {0, 3, 9, 10, 50, len(small_blob) - 1, len(small_blob) - 8, len(small_blob) // 2}
    for lo, hi in offsets.values():
        cuts.update((lo, (lo + hi) // 2))
    for cut in sorted(cuts):
        if cut >= len(small_blob):
            continue
        with pytest.raises(CodecError):
            decode(small_blob[:cut])
    # one extra trailing byte is refused too
    with pytest.raises(CodecError):
        decode(small_blob + b"\0")


# ---------------------------------------------------------------------------------------------
# crafted blobs (valid checksums recomputed, so only the named field is wrong)


def test_helper_rebuilds_the_blob_exactly(small_blob):
    assert build_blob(parse_blob(small_blob)) == small_blob


def test_huge_declared_shape_is_refused_without_allocating(small_blob):
    p = parse_blob(small_blob)
    shape = [30, 2_000_000, 192]
    p.header["shape"] = shape
    p.header["raw_nbytes"] = 2 * 30 * 2_000_000 * 192 * 2  # consistent with the shape: 46 GB
    if p.header["compression"] == "none":
        p.header["payload_nbytes"] = p.header["raw_nbytes"]  # consistent too: only the blob is short
    crafted = build_blob(p)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(CodecError, match="cap") as info:
            decode(crafted)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "raw_nbytes" in str(info.value)
    assert peak < 4 * 1024 * 1024, peak


def test_declared_size_over_custom_cap_is_refused(small_blob, small_fragment):
    with pytest.raises(CodecError, match="cap"):
        decode(small_blob, max_raw_bytes=small_fragment.raw_nbytes - 1)
    assert_same_fragment(small_fragment, decode(small_blob, max_raw_bytes=small_fragment.raw_nbytes))


@pytest.mark.parametrize("shape", [[2**32, 2**32, 1], [2**62, 2, 2]])
def test_shape_whose_product_overflows_is_refused_with_codec_error(small_blob, shape):
    p = parse_blob(small_blob)
    p.header["shape"] = shape
    p.header["raw_nbytes"] = 0  # what the shape's product comes to in 64-bit arithmetic
    if p.header["compression"] == "none":
        p.payload = b""
    else:
        p.payload = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b"")
    p.header["payload_nbytes"] = len(p.payload)
    with pytest.raises(CodecError):
        decode(build_blob(p))


def test_raw_nbytes_disagreeing_with_shape_is_refused(small_blob):
    p = parse_blob(small_blob)
    p.header["raw_nbytes"] += 2
    with pytest.raises(CodecError, match="raw_nbytes"):
        decode(build_blob(p))


def test_shape_disagreeing_with_span_is_refused(small_blob):
    # shape [2, 32, 384] has the same byte count as [2, 64, 192]: sizes agree, invariants do not
    p = parse_blob(small_blob)
    p.header["shape"] = [2, 32, 384]
    with pytest.raises(CodecError, match="keys"):
        decode(build_blob(p))


def test_wrong_content_hash_is_refused(small_blob):
    p = parse_blob(small_blob)
    p.header["content_hash"] = content_hash(np.arange(64))
    with pytest.raises(CodecError, match="content_hash"):
        decode(build_blob(p))


def test_tokens_changed_under_valid_checksum_are_refused_by_content_hash(small_blob):
    p = parse_blob(small_blob)
    ids = bytearray(p.ids)
    ids[0] ^= 1
    p.ids = bytes(ids)
    with pytest.raises(CodecError, match="content_hash"):
        decode(build_blob(p))


def test_wrong_magic_is_refused(small_blob):
    with pytest.raises(CodecError, match="magic"):
        decode(build_blob(parse_blob(small_blob), magic=b"ESKW"))


@pytest.mark.parametrize("version", [0, 3, 65535])
def test_other_version_is_refused(small_blob, version):
    p = parse_blob(small_blob)
    p.version = version
    with pytest.raises(CodecError, match="version") as info:
        decode(build_blob(p))
    assert str(version) in str(info.value)


def test_format2_layout_labelled_version_1_is_refused(small_blob):
    # read as format 1, the head's checksum is a crc32 that the xxh3 bytes are not
    p = parse_blob(small_blob)
    p.version = 1
    with pytest.raises(CodecError, match="head checksum: crc32"):
        decode(build_blob(p))


def test_payload_frame_lying_about_its_size_is_refused(small_fragment):
    p = parse_blob(encode(small_fragment, "zstd"))
    raw = zstandard.ZstdDecompressor().decompress(p.payload)
    # a frame of a different size than the header declares
    p.payload = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw[:-2])
    p.header["payload_nbytes"] = len(p.payload)
    with pytest.raises(CodecError, match="payload: zstd frame declares"):
        decode(build_blob(p))
    # a frame without its content size
    p.payload = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(raw)
    p.header["payload_nbytes"] = len(p.payload)
    with pytest.raises(CodecError, match="payload"):
        decode(build_blob(p))
    # not a zstd frame at all
    p.payload = b"\x00" * 64
    p.header["payload_nbytes"] = 64
    with pytest.raises(CodecError, match="payload"):
        decode(build_blob(p))


def test_compression_label_lying_is_refused(small_fragment):
    # raw K/V labelled zstd: not a zstd frame
    p = parse_blob(encode(small_fragment, "none"))
    p.header["compression"] = "zstd"
    with pytest.raises(CodecError, match="payload"):
        decode(build_blob(p))
    # a zstd frame labelled raw: its size is not K and V's
    p = parse_blob(encode(small_fragment, "zstd"))
    p.header["compression"] = "none"
    with pytest.raises(CodecError, match="payload_nbytes"):
        decode(build_blob(p))


@pytest.mark.parametrize("delta", [-1, 1])
def test_payload_nbytes_lie_is_refused(small_blob, delta):
    p = parse_blob(small_blob)
    p.header["payload_nbytes"] += delta
    crafted = build_blob(p)  # header now disagrees with the bytes the blob holds
    with pytest.raises(CodecError, match="payload_nbytes"):
        decode(crafted)


@pytest.mark.parametrize(
    "field, value",
    [
        ("token_end", 1e999),  # JSON 1e999 is float('inf') in Python
        ("layer_start", 1e999),
        ("shape", [1e999, 64, 192]),
        ("token_end", "NaN"),
        ("namespace", [1, 2]),
        ("prefix_hash", "zz"),
        ("embedding_dim", 7),
        ("compression", "lz4"),
        ("compression", None),
        ("v_order", "diagonal"),
    ],
)
def test_crafted_non_numeric_or_infinite_header_fields_raise_codec_error(small_blob, field, value):
    p = parse_blob(small_blob)
    p.header[field] = value
    crafted = build_blob(p)
    with pytest.raises(CodecError):
        decode(crafted)
    with pytest.raises(CodecError):
        peek(crafted)


# ---------------------------------------------------------------------------------------------
# format-1 blobs (tests/format1.py's own encoder): read, never written


@pytest.fixture(scope="module")
def v1_blob(small_fragment) -> bytes:
    return encode_v1(small_fragment)


def test_format1_blob_decodes_to_the_same_fragment_and_peeks(small_fragment, v1_blob):
    assert v1_blob[4:6] == b"\x01\x00"
    assert_same_fragment(small_fragment, decode(v1_blob))
    assert_same_fragment(small_fragment, decode(memoryview(v1_blob), copy=False))
    # a V staged transposed is written token order by format 1 and reads back equal
    assert encode_v1(channel(small_fragment)) == v1_blob
    head = peek(v1_blob)
    assert (head.version, head.compression, head.v_order) == (1, "zstd", "token")
    assert head.content_hash == small_fragment.content_hash
    assert np.array_equal(head.token_ids, small_fragment.token_ids)
    n = v1_head_nbytes(v1_blob)
    assert head.head_nbytes == head.payload_at == n  # no padding in format 1
    assert head.blob_nbytes == len(v1_blob) == n + head.payload_nbytes + 4
    assert head_of(v1_blob) == v1_blob[:n]
    assert_same_header(peek(head_of(v1_blob)), head)
    # written again, it is a format-2 blob of the same fragment
    again = encode(decode(v1_blob))
    assert parse_blob(again).version == 2
    assert_same_fragment(small_fragment, decode(again))


def test_a_flipped_byte_in_a_format1_blob_is_refused(small_fragment, v1_blob):
    n = v1_head_nbytes(v1_blob)
    ids_at = n - 4 - 4 * EMBEDDING_DIM - 4 * small_fragment.span
    cases = {
        0: "magic",
        4: "version",
        ids_at + 1: "head checksum: crc32",
        n - 4: "head checksum: crc32",
        n - 1: "head checksum: crc32",
        n: "payload checksum: crc32",
        n + 100: "payload checksum: crc32",
        len(v1_blob) - 1: "payload checksum: crc32",
    }
    for pos, expected in cases.items():
        corrupt = bytearray(v1_blob)
        corrupt[pos] ^= 0x10  # fake for a corrupt page
        with pytest.raises(CodecError, match=expected):
            decode(bytes(corrupt))
    rng = np.random.default_rng(1)
    for pos in sorted(set(range(0, n, 7)) | {int(x) for x in rng.integers(n, len(v1_blob), size=200)}):
        corrupt = bytearray(v1_blob)
        corrupt[pos] ^= 0x01
        with pytest.raises(CodecError):
            decode(bytes(corrupt))
    for cut in (n - 1, n, n + 10, len(v1_blob) - 1):
        with pytest.raises(CodecError):
            decode(v1_blob[:cut])


def test_codec_error_is_a_value_error():
    assert issubclass(CodecError, ValueError)
    with pytest.raises(ValueError):
        decode(b"")
    assert codec.FORMAT_VERSION == 2 and codec.READABLE_VERSIONS == (1, 2)
