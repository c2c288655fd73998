"""Tests for edgesync_store.schema: invariants, hashes, store keys and chunking.

No mocks. Fragments use a SmolLM2-like llama.cpp namespace (30 layers, 3 KV heads of 64) and
seeded random f16 tensors; hashes are recomputed here from the module docstring's spec with
hashlib and struct, independently of the module's helpers.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgesync_store.schema import (
    DEFAULT_TTL_SECONDS,
    EMBEDDING_DIM,
    MAX_SPAN,
    MIN_SPAN,
    KVFragment,
    Namespace,
    chunk_spans,
    common_prefix_len,
    content_hash,
    prefix_hash,
    store_key,
)

REPO = Path(__file__).resolve().parents[1]

from fragments import SMOL  # noqa: E402  (tests/fragments.py)


def _spec_token_bytes(ids) -> bytes:
    return struct.pack(f"<{len(ids)}i", *[int(i) for i in ids])


def _make_kwargs(
    ns: Namespace = SMOL,
    token_start: int = 0,
    span: int = 64,
    layers: tuple[int, int, int] = (0, 30, 1),
    heads: tuple[int, int] = (0, 3),
    seed: int = 0,
) -> dict:
    """Constructor kwargs of a valid fragment (random f16 K/V, random token IDs)."""
    rng = np.random.default_rng(seed)
    n_layers = len(range(*layers))
    width = (heads[1] - heads[0]) * ns.head_dim
    shape = (n_layers, span, width)
    all_ids = rng.integers(0, 49152, size=token_start + span, dtype=np.int32)
    return dict(
        namespace=ns,
        token_start=token_start,
        token_end=token_start + span,
        layer_start=layers[0],
        layer_end=layers[1],
        layer_stride=layers[2],
        head_start=heads[0],
        head_end=heads[1],
        keys=rng.standard_normal(shape).astype(ns.np_dtype),
        values=rng.standard_normal(shape).astype(ns.np_dtype),
        token_ids=all_ids[token_start:],
        prefix_hash=prefix_hash(all_ids[:token_start]),
    )


# ---------------------------------------------------------------------------------------------
# invariants


def _bad(**changes):
    def build():
        kw = _make_kwargs()
        kw.update(changes)
        return kw

    return build


def _shape(n_layers, span, width, dtype=np.float16):
    return np.zeros((n_layers, span, width), dtype=dtype)


INVALID = [
    # (id, field the message must start with, kwargs builder)
    ("span<64", "token_end", lambda: _make_kwargs(span=64) | {"token_end": 63, "token_ids": np.arange(63)}),
    ("span>2048", "token_end", lambda: _make_kwargs(span=64) | {"token_end": 2049, "token_ids": np.arange(2049)}),
    ("token_start<0", "token_start", lambda: _make_kwargs() | {"token_start": -1, "token_end": 63}),
    ("layer_end>n_layer", "layer_end", lambda: _make_kwargs() | {"layer_end": 31}),
    ("layer_start==layer_end", "layer_start", lambda: _make_kwargs() | {"layer_start": 30, "layer_end": 30}),
    ("layer_start>layer_end", "layer_start", lambda: _make_kwargs() | {"layer_start": 10, "layer_end": 5}),
    ("layer_stride=0", "layer_stride", lambda: _make_kwargs() | {"layer_stride": 0}),
    ("head_end>n_head_kv", "head_end", lambda: _make_kwargs() | {"head_end": 4}),
    ("head_start==head_end", "head_start", lambda: _make_kwargs() | {"head_start": 2, "head_end": 2}),
    ("head_start>head_end", "head_start", lambda: _make_kwargs() | {"head_start": 2, "head_end": 1}),
    ("len(token_ids)!=span", "token_ids", lambda: _make_kwargs() | {"token_ids": np.arange(65)}),
    ("empty keys", "keys", lambda: _make_kwargs() | {"keys": np.zeros((0,), np.float16)}),
    ("keys span mismatch", "keys", lambda: _make_kwargs() | {"keys": _shape(30, 65, 192)}),
    # layers 0..30 stride 3 hold 10 layers, not 30
    ("keys stride layers", "keys", lambda: _make_kwargs() | {"layer_stride": 3}),
    ("keys layer range", "keys", lambda: _make_kwargs() | {"layer_end": 15}),
    # heads [1, 3) are 128 wide, not 192
    ("keys heads", "keys", lambda: _make_kwargs() | {"head_start": 1}),
    ("values shape", "values", lambda: _make_kwargs() | {"values": _shape(30, 64, 128)}),
    ("values dtype", "values", lambda: _make_kwargs() | {"values": _shape(30, 64, 192, np.float32)}),
    ("keys dtype", "keys", lambda: _make_kwargs() | {"keys": _shape(30, 64, 192, np.float32)}),
    ("prefix_hash 31 bytes", "prefix_hash", lambda: _make_kwargs() | {"prefix_hash": b"\0" * 31}),
    ("prefix_hash hex str", "prefix_hash", lambda: _make_kwargs() | {"prefix_hash": "00" * 32}),
    ("embedding size", "embedding", lambda: _make_kwargs() | {"embedding": np.zeros(383, np.float32)}),
    ("embedding nan", "embedding", lambda: _make_kwargs() | {"embedding": np.full(EMBEDDING_DIM, np.nan)}),
    ("content_hash", "content_hash", lambda: _make_kwargs() | {"content_hash": content_hash(np.arange(64))}),
    ("hit_count<0", "hit_count", lambda: _make_kwargs() | {"hit_count": -1}),
    ("expires_at<0", "expires_at", lambda: _make_kwargs() | {"expires_at": -5.0}),
]


@pytest.mark.parametrize("field_name, build", [(f, b) for _, f, b in INVALID], ids=[i for i, _, _ in INVALID])
def test_invariant_violation_raises_value_error_naming_field(field_name, build):
    kwargs = build()
    with pytest.raises(ValueError) as info:
        KVFragment(**kwargs)
    assert str(info.value).startswith(field_name), str(info.value)


def covers_all(frag: KVFragment) -> bool:
    """True when the fragment holds every layer and every KV head of its model."""
    return (frag.layer_start == 0 and frag.layer_stride == 1 and frag.layer_end == frag.namespace.n_layer
            and frag.head_start == 0 and frag.head_end == frag.namespace.n_head_kv)


def test_valid_fragments_construct_with_documented_defaults():
    frag = KVFragment(**_make_kwargs(layers=(0, 30, 3), heads=(1, 3), span=100, token_start=64))
    assert frag.n_layers == 10
    assert list(frag.layers) == list(range(0, 30, 3))
    assert frag.keys.shape == (10, 100, 128)
    assert frag.span == 100
    assert frag.token_ids.dtype == np.int32
    assert not covers_all(frag)
    assert frag.content_hash == content_hash(frag.token_ids)
    assert frag.expires_at == pytest.approx(frag.created_at + DEFAULT_TTL_SECONDS)
    assert frag.embedding.shape == (0,)
    assert frag.raw_nbytes == 2 * 10 * 100 * 128 * 2

    whole = KVFragment(**_make_kwargs())
    assert whole.head_end == 3 and covers_all(whole)
    # span limits are inclusive
    for span in (MIN_SPAN, MAX_SPAN):
        kw = _make_kwargs(span=span, layers=(0, 1, 1))
        assert KVFragment(**kw).span == span


def test_namespace_invariants_name_field():
    with pytest.raises(ValueError, match=r"^namespace\.kv_dtype"):
        replace(SMOL, kv_dtype="q5_k")
    with pytest.raises(ValueError, match=r"^namespace\.head_dim: 48 is not whole q8_0 blocks"):
        replace(SMOL, kv_dtype="q8_0", head_dim=48)
    q8 = replace(SMOL, kv_dtype="q8_0")
    assert q8.quantized and q8.head_width == SMOL.head_dim // 32 * 34 and q8.np_dtype == np.uint8
    assert q8.digest() != SMOL.digest()
    with pytest.raises(ValueError, match=r"^namespace\.n_layer"):
        replace(SMOL, n_layer=0)
    with pytest.raises(ValueError, match=r"^namespace\.model_fingerprint"):
        replace(SMOL, model_fingerprint="")
    with pytest.raises(ValueError, match=r"^namespace\.head_dim: missing"):
        Namespace.from_dict({k: v for k, v in SMOL.to_dict().items() if k != "head_dim"})
    assert Namespace.from_dict(json.loads(json.dumps(SMOL.to_dict()))) == SMOL


# ---------------------------------------------------------------------------------------------
# hashes


def test_content_hash_matches_documented_encoding():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 2**31 - 1, size=200).tolist()
    expected = hashlib.sha256(b"edgesync/content/v1\0" + _spec_token_bytes(ids)).hexdigest()
    assert content_hash(ids) == expected
    assert content_hash(np.asarray(ids, dtype=np.int64)) == expected
    frag = KVFragment(**(_make_kwargs() | {"token_ids": np.asarray(ids[:64])}))
    assert frag.content_hash == hashlib.sha256(b"edgesync/content/v1\0" + _spec_token_bytes(ids[:64])).hexdigest()
    # one token changed -> another hash
    assert content_hash(ids[:-1] + [ids[-1] ^ 1]) != expected


def test_prefix_hash_matches_documented_encoding_including_empty_prefix():
    assert prefix_hash([]) == hashlib.sha256(b"edgesync/prefix/v1\0").digest()
    ids = [1, 2, 3, 70000, 2**31 - 1]
    assert prefix_hash(ids) == hashlib.sha256(b"edgesync/prefix/v1\0" + _spec_token_bytes(ids)).digest()
    assert len(prefix_hash(ids)) == 32
    # the prefix hash and the content hash of the same tokens differ (domain tags)
    assert prefix_hash(ids).hex() != content_hash(ids)


def test_store_key_matches_documented_encoding():
    frag = KVFragment(**_make_kwargs(token_start=128, layers=(3, 27, 4), heads=(1, 2), seed=5))
    ranges = struct.pack("<6i", 3, 27, 4, 1, 2, 128)
    expected = hashlib.sha256(
        b"edgesync/key/v1\0"
        + SMOL.digest()
        + frag.prefix_hash
        + _spec_token_bytes(frag.token_ids)
        + ranges
    ).digest()
    assert frag.key() == expected
    canonical = json.dumps(SMOL.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    assert SMOL.digest() == hashlib.sha256(b"edgesync/namespace/v1\0" + canonical).digest()


def _key_args(ns=SMOL, prefix=None, ids=None, token_start=0, layers=(0, 30, 1), heads=(0, 3)):
    ids = list(range(100, 164)) if ids is None else ids
    prefix = prefix_hash([]) if prefix is None else prefix
    return (ns, prefix, ids, token_start, layers[0], layers[1], layers[2], heads[0], heads[1])


def test_store_key_separates_every_input():
    base = store_key(*_key_args())
    assert base == store_key(*_key_args())  # deterministic
    assert len(base) == 32
    variants = {
        "prefix": store_key(*_key_args(prefix=prefix_hash([7]))),
        "flash_attn": store_key(*_key_args(ns=replace(SMOL, flash_attn=True))),
        "model": store_key(*_key_args(ns=replace(SMOL, model_fingerprint="cd" * 32))),
        "kv_dtype": store_key(*_key_args(ns=replace(SMOL, kv_dtype="f32"))),
        "engine_version": store_key(*_key_args(ns=replace(SMOL, engine_version="other"))),
        "layout": store_key(*_key_args(ns=replace(SMOL, layout="other"))),
        "kernels": store_key(*_key_args(ns=replace(SMOL, kernels="other"))),
        "layer_end": store_key(*_key_args(layers=(0, 15, 1))),
        "layer_start": store_key(*_key_args(layers=(15, 30, 1))),
        "layer_stride": store_key(*_key_args(layers=(0, 30, 2))),
        "heads": store_key(*_key_args(heads=(0, 2))),
        "token_start": store_key(*_key_args(token_start=64)),
        "tokens": store_key(*_key_args(ids=list(range(100, 163)) + [0])),
    }
    for name, key in variants.items():
        assert key != base, name
    assert len(set(variants.values())) == len(variants)


def test_a_record_written_before_the_kernel_digest_keeps_its_digest_and_reads_as_unprobed():
    """A fragment header without ``kernels`` (written before the field existed) reads as
    ``kernels=""`` and hashes as before (its index entries stay valid), while no probed
    namespace (which always has a digest) can equal it."""
    legacy = {k: v for k, v in SMOL.to_dict().items() if k != "kernels"}
    ns = Namespace.from_dict(legacy)
    assert ns.kernels == "" and ns.to_dict() == legacy
    canonical = json.dumps(legacy, sort_keys=True, separators=(",", ":")).encode()
    assert ns.digest() == hashlib.sha256(b"edgesync/namespace/v1\0" + canonical).digest()
    assert ns.digest() != SMOL.digest() and SMOL.to_dict()["kernels"] == SMOL.kernels
    with pytest.raises(ValueError, match="namespace.kernels"):
        replace(SMOL, kernels=None)


_SUBPROCESS_KEY = r"""
import sys, json
from dataclasses import replace
from edgesync_store.schema import Namespace, store_key, prefix_hash, content_hash
ns = Namespace.from_dict(json.loads(sys.argv[1]))
key = store_key(ns, prefix_hash(list(range(40))), list(range(100, 164)), 40, 0, 30, 3, 1, 3)
print(key.hex(), ns.digest().hex(), content_hash(list(range(100, 164))))
"""


def test_hashes_are_stable_across_processes():
    mine = [
        store_key(SMOL, prefix_hash(list(range(40))), list(range(100, 164)), 40, 0, 30, 3, 1, 3).hex(),
        SMOL.digest().hex(),
        content_hash(list(range(100, 164))),
    ]
    outs = []
    for seed in ("1", "12345"):  # different str-hash randomisation per process
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_KEY, json.dumps(SMOL.to_dict())],
            capture_output=True, text=True, cwd=REPO, env=env, timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout.split())
    assert outs[0] == mine
    assert outs[1] == mine


# ---------------------------------------------------------------------------------------------
# chunking


@settings(max_examples=300, deadline=None)
@given(n=st.integers(min_value=0, max_value=5000), chunk=st.one_of(st.just(128), st.integers(64, MAX_SPAN - 63)))
def test_chunk_spans_tile_the_sequence(n, chunk):
    spans = chunk_spans(n, chunk)
    if n < MIN_SPAN:
        assert spans == []
        return
    assert spans[0][0] == 0
    assert spans[-1][1] == n
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end == start  # contiguous, no gap, no overlap
    for start, end in spans:
        assert MIN_SPAN <= end - start <= MAX_SPAN
    for start, end in spans[:-1]:
        assert end - start == chunk
    assert sum(e - s for s, e in spans) == n
    # the last span is shorter than chunk + MIN_SPAN (it only absorbs a short remainder)
    assert spans[-1][1] - spans[-1][0] < chunk + MIN_SPAN


def test_chunk_spans_examples_and_bad_chunk():
    assert chunk_spans(300) == [(0, 128), (128, 300)]
    assert chunk_spans(330) == [(0, 128), (128, 256), (256, 330)]
    assert chunk_spans(63) == []
    assert chunk_spans(64) == [(0, 64)]
    with pytest.raises(ValueError, match="^chunk_tokens"):
        chunk_spans(1000, 63)
    with pytest.raises(ValueError, match="^chunk_tokens"):
        chunk_spans(1000, MAX_SPAN)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2, 3], [1, 2]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(np.arange(500), np.arange(500)) == 500
    assert common_prefix_len([9, 2], [1, 2]) == 0
