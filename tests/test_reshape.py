"""KV layout conversion between llama.cpp and ONNX fragments (edgesync_engines/adapters/reshape.py):
the mechanics, on seeded arrays of SmolLM2's geometry (30 layers, 3 KV heads of 64). Whether the
converted KV serves the other engine is tested with the real export (test_cross_engine.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fake_adapter import fake_namespace

from edgesync_engines.adapters.reshape import convert_fragment, halves_to_interleaved, interleaved_to_halves
from edgesync_store.schema import KVFragment, prefix_hash

N_LAYERS, SPAN, HEADS, HEAD_DIM = 30, 70, 3, 64
LLAMA = fake_namespace("llama.cpp", n_layer=N_LAYERS, n_head_kv=HEADS, head_dim=HEAD_DIM)
ONNX = fake_namespace("onnxruntime", n_layer=N_LAYERS, n_head_kv=HEADS, head_dim=HEAD_DIM)


def fragment(ns, keys, values) -> KVFragment:
    span = keys.shape[1]
    return KVFragment(namespace=ns, token_start=0, token_end=span, layer_start=0, layer_end=N_LAYERS,
                      keys=keys, values=values, token_ids=np.arange(span, dtype=np.int32), prefix_hash=prefix_hash([]))


@pytest.fixture
def kv():
    rng = np.random.default_rng(0)
    shape = (N_LAYERS, SPAN, HEADS * HEAD_DIM)
    return rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(np.float16)


def test_rotary_permutation_is_the_measured_one():
    """DESIGN.md 2.3: k_ggml = k_hf.reshape(T, 2, 32).transpose(0, 2, 1).reshape(T, 64)."""
    k_hf = np.arange(5 * 64, dtype=np.float32).reshape(5, 64)
    expected = k_hf.reshape(5, 2, 32).transpose(0, 2, 1).reshape(5, 64)
    assert np.array_equal(halves_to_interleaved(k_hf, 64), expected)
    assert np.array_equal(interleaved_to_halves(expected, 64), k_hf)
    # dimension 2i of llama.cpp's pair i is HF's i, dimension 2i + 1 is HF's i + 32
    assert halves_to_interleaved(k_hf, 64)[0, :4].tolist() == [0, 32, 1, 33]


def test_llamacpp_to_onnx_places_every_element(kv):
    k, v = kv
    out = convert_fragment(fragment(LLAMA, k, v), ONNX)
    ok, ov = out.keys, out.values
    assert out.namespace == ONNX and ok.shape == ov.shape == (N_LAYERS, SPAN, HEADS * HEAD_DIM)
    assert ok.dtype == ov.dtype == np.float32 and ok.flags.c_contiguous
    for layer, head, t in ((0, 0, 0), (7, 2, 69), (29, 1, 33)):
        cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
        assert np.array_equal(ov[layer, t, cols], v[layer, t, cols].astype(np.float32))
        assert np.array_equal(ok[layer, t, cols], interleaved_to_halves(k[layer, t, cols], HEAD_DIM).astype(np.float32))


def test_round_trip_from_llamacpp_is_exact(kv):
    k, v = kv
    there = convert_fragment(fragment(LLAMA, k, v), ONNX)
    back = convert_fragment(there, LLAMA)
    assert back.keys.dtype == np.float16 and back.namespace == LLAMA
    assert np.array_equal(back.keys, k) and np.array_equal(back.values, v)
    assert convert_fragment(back, LLAMA) is back  # already of the target


def test_onnx_to_llamacpp_rounds_float32_to_nearest_float16():
    rng = np.random.default_rng(1)
    ok = rng.standard_normal((N_LAYERS, 64, HEADS * HEAD_DIM)).astype(np.float32)
    ov = rng.standard_normal((N_LAYERS, 64, HEADS * HEAD_DIM)).astype(np.float32)
    out = convert_fragment(fragment(ONNX, ok, ov), LLAMA)
    k, v = out.keys, out.values
    assert k.shape == (N_LAYERS, 64, HEADS * HEAD_DIM) and k.dtype == np.float16
    assert np.array_equal(v[1, 3, HEAD_DIM:2 * HEAD_DIM], ov[1, 3, HEAD_DIM:2 * HEAD_DIM].astype(np.float16))
    assert np.array_equal(k[1, 3, :HEAD_DIM], halves_to_interleaved(ok[1, 3, :HEAD_DIM], HEAD_DIM).astype(np.float16))
    # the rounding is the only change: converting back to f32 differs by at most half an f16 ulp
    back = convert_fragment(out, ONNX).keys
    assert 0 < np.abs(back - ok).max() <= np.abs(ok).max() * 2.0 ** -11


def test_bad_shapes_and_namespaces_are_refused_with_the_reason(kv):
    k, v = kv
    other = dataclasses.replace(ONNX, model_fingerprint="0" * 64)
    with pytest.raises(ValueError, match="cannot serve onnxruntime: another model"):
        convert_fragment(fragment(LLAMA, k, v), other)
    with pytest.raises(ValueError, match="another head layout"):
        convert_fragment(fragment(LLAMA, k, v), dataclasses.replace(ONNX, n_head_kv=4, head_dim=48))
    with pytest.raises(ValueError, match="head_dim: must be an even"):
        halves_to_interleaved(np.zeros((2, 63)), 63)
    with pytest.raises(ValueError, match="last axis is 64, not head_dim 32"):
        interleaved_to_halves(np.zeros((2, 64)), 32)
