"""KV layout conversion between llama.cpp and ONNX caches (edgesync_engines/adapters/reshape.py): the
mechanics, on seeded arrays of SmolLM2's geometry (30 layers, 3 KV heads of 64). Whether the
converted KV serves the other engine is tested with the real export (test_cross_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest

from edgesync_engines.adapters.reshape import (
    halves_to_interleaved,
    interleaved_to_halves,
    llamacpp_to_onnx,
    onnx_to_llamacpp,
)

N_LAYERS, SPAN, HEADS, HEAD_DIM = 30, 70, 3, 64


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
    ok, ov = llamacpp_to_onnx(k, v, HEADS, HEAD_DIM)
    assert ok.shape == ov.shape == (N_LAYERS, 1, HEADS, SPAN, HEAD_DIM)
    assert ok.dtype == ov.dtype == np.float32 and ok.flags.c_contiguous
    for layer, head, t in ((0, 0, 0), (7, 2, 69), (29, 1, 33)):
        cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
        assert np.array_equal(ov[layer, 0, head, t], v[layer, t, cols].astype(np.float32))
        assert np.array_equal(
            ok[layer, 0, head, t], interleaved_to_halves(k[layer, t, cols], HEAD_DIM).astype(np.float32)
        )


def test_round_trip_from_llamacpp_is_exact(kv):
    k, v = kv
    back_k, back_v = onnx_to_llamacpp(*llamacpp_to_onnx(k, v, HEADS, HEAD_DIM))
    assert back_k.dtype == np.float16
    assert np.array_equal(back_k, k) and np.array_equal(back_v, v)


def test_onnx_to_llamacpp_rounds_float32_to_nearest_float16():
    rng = np.random.default_rng(1)
    ok = rng.standard_normal((2, 1, HEADS, 8, HEAD_DIM)).astype(np.float32)
    ov = rng.standard_normal((2, 1, HEADS, 8, HEAD_DIM)).astype(np.float32)
    k, v = onnx_to_llamacpp(ok, ov)
    assert k.shape == (2, 8, HEADS * HEAD_DIM) and k.dtype == np.float16
    assert np.array_equal(v[1, 3, HEAD_DIM:2 * HEAD_DIM], ov[1, 0, 1, 3].astype(np.float16))
    assert np.array_equal(k[1, 3, :HEAD_DIM], halves_to_interleaved(ok[1, 0, 0, 3], HEAD_DIM).astype(np.float16))
    # the rounding is the only change: converting back to f32 differs by at most half an f16 ulp
    back, _ = llamacpp_to_onnx(k, v, HEADS, HEAD_DIM)
    assert 0 < np.abs(back - ok).max() <= np.abs(ok).max() * 2.0 ** -11


def test_bad_shapes_are_refused_with_the_reason(kv):
    k, v = kv
    with pytest.raises(ValueError, match="width 192 != n_head 4 x head_dim 64"):
        llamacpp_to_onnx(k, v, 4, HEAD_DIM)
    with pytest.raises(ValueError, match="keys/values"):
        llamacpp_to_onnx(k, v[:, :10], HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="head_dim: must be an even"):
        halves_to_interleaved(np.zeros((2, 63)), 63)
    with pytest.raises(ValueError, match="last axis is 64, not head_dim 32"):
        interleaved_to_halves(np.zeros((2, 64)), 32)
    with pytest.raises(ValueError, match=r"\[n_layers, 1, n_head, span, head_dim\]"):
        onnx_to_llamacpp(np.zeros((2, 2, 3, 4, 64), np.float32), np.zeros((2, 2, 3, 4, 64), np.float32))
