"""compatible_with's matrix on hand-made namespaces, and the real Gemma 3 270M, whose KV crosses
to no other engine."""

from __future__ import annotations

import dataclasses

import pytest

from edgesync_engines.adapters.compat import (
    COMPATIBLE,
    CONVERTIBLE,
    CONVERTIBLE_LAYOUT_OPTIONS,
    INCOMPATIBLE,
    compatible_with,
    layout_refusal,
)
from edgesync_engines.adapters.llamacpp import LAYOUT as LLAMA_LAYOUT
from edgesync_engines.adapters.onnxrt import LAYOUT as ONNX_LAYOUT
from edgesync_store.schema import KV_DTYPES, Namespace

LLAMA = Namespace(
    "a" * 64, "llama.cpp", "llama-cpp-python 0.3.36", "f16", False, LLAMA_LAYOUT + ";v_trans=1", 30, 3, 64, "k" * 64
)
ONNX = Namespace("a" * 64, "onnxruntime", "onnxruntime 1.32.0; v1", "f32", False, ONNX_LAYOUT, 30, 3, 64, "o" * 64)


@pytest.mark.parametrize("a, b, verdict, reason", [
    (LLAMA, LLAMA, COMPATIBLE, "same engine"),
    (ONNX, ONNX, COMPATIBLE, "same engine"),
    (LLAMA, ONNX, CONVERTIBLE, "K rotary pairs interleaved -> rotate-half"),
    (ONNX, LLAMA, CONVERTIBLE, "K rotary pairs rotate-half -> interleaved"),
    (LLAMA, dataclasses.replace(LLAMA, flash_attn=True), CONVERTIBLE, "flash_attn False -> True"),
    (LLAMA, dataclasses.replace(LLAMA, engine_version="llama-cpp-python 0.3.37"), CONVERTIBLE, "engine_version"),
    # the same build's KV from other kernels (another machine's architecture): never exact
    (LLAMA, dataclasses.replace(LLAMA, kernels="n" * 64), CONVERTIBLE, "kernels 'kkkk"),
    (LLAMA, dataclasses.replace(ONNX, model_fingerprint="b" * 64), INCOMPATIBLE, "another model"),
    (LLAMA, dataclasses.replace(ONNX, n_head_kv=2, head_dim=16), INCOMPATIBLE, "another head layout"),
    (ONNX, dataclasses.replace(ONNX, n_layer=2, engine_version="other"), INCOMPATIBLE, "another head layout"),
    (LLAMA, dataclasses.replace(LLAMA, layout="gemma3-two-part/v1"), INCOMPATIBLE, "no conversion for layout"),
])
def test_matrix(a, b, verdict, reason):
    got = compatible_with(a, b)
    assert got.verdict == verdict and reason in got.reason, got
    assert compatible_with(b, a).verdict == verdict
    assert got.usable == (verdict != INCOMPATIBLE)


def test_anything_without_a_namespace_is_a_type_error():
    with pytest.raises(TypeError, match="expected a Namespace"):
        compatible_with(LLAMA, "llama.cpp")


# Gemma 3 270M's geometry (18 layers x 1 KV head x 256); its llama.cpp layout records the two
# cache parts as a layout option (the option's text here is an example, not the codec's)
GEMMA_LLAMA = Namespace("c" * 64, "llama.cpp", "llama-cpp-python 0.3.36", "f16", False,
                        LLAMA_LAYOUT + ";v_trans=1;parts=global:0,6,12+swa512:rest", 18, 1, 256, "k" * 64)


@pytest.mark.parametrize("other, reason", [
    (dataclasses.replace(ONNX, model_fingerprint="c" * 64, n_layer=18, n_head_kv=1, head_dim=256),
     "no conversion for layout option 'parts=global:0,6,12+swa512:rest' of llama.cpp"),
    (dataclasses.replace(GEMMA_LLAMA, flash_attn=True), "no conversion for layout option 'parts="),
])
def test_a_multi_part_cache_converts_to_nothing(other, reason):
    for a, b in ((GEMMA_LLAMA, other), (other, GEMMA_LLAMA)):
        got = compatible_with(a, b)
        assert got.verdict == INCOMPATIBLE and reason in got.reason and not got.usable, got
    assert compatible_with(GEMMA_LLAMA, GEMMA_LLAMA).verdict == COMPATIBLE  # its own KV is exact
    assert layout_refusal(LLAMA) is None and layout_refusal(ONNX) is None
    assert "v_trans" in CONVERTIBLE_LAYOUT_OPTIONS


@pytest.mark.skipif("q8_0" not in KV_DTYPES, reason="the store does not record quantized KV yet")
def test_quantized_kv_converts_to_nothing():
    q8 = dataclasses.replace(LLAMA, kv_dtype="q8_0", flash_attn=True)
    for other in (LLAMA, ONNX):
        got = compatible_with(q8, other)
        assert got.verdict == INCOMPATIBLE and "no conversion for KV type 'q8_0'" in got.reason
    assert compatible_with(q8, q8).verdict == COMPATIBLE


@pytest.mark.model
def test_gemma3_kv_never_crosses_engines():
    """The real Gemma 3 270M: the ONNX export refuses it (sliding window), so no onnxruntime
    namespace exists for it; whatever llama.cpp records for it converts to no other engine."""
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
    from edgesync_engines.adapters.model_files import file_fingerprint, gemma3_model_path
    from edgesync_engines.adapters.onnx_support import onnx_refusal

    path = gemma3_model_path()
    assert "gemma3: sliding-window attention (window 512 tokens) is not exported" in onnx_refusal(path)
    adapter = LlamaCppAdapter(path, n_ctx=1024)
    try:
        ns = adapter.namespace
        if ns is None:  # served uncached: nothing is stored, so nothing can cross
            assert "sliding-window" in adapter.cache_refusal
            return
        assert ns.model_fingerprint == file_fingerprint(path)
        onnx_like = dataclasses.replace(ONNX, model_fingerprint=ns.model_fingerprint, n_layer=ns.n_layer,
                                        n_head_kv=ns.n_head_kv, head_dim=ns.head_dim)
        got = compatible_with(ns, onnx_like)
        assert got.verdict == INCOMPATIBLE and "no conversion for layout" in got.reason, got
    finally:
        adapter.close()
