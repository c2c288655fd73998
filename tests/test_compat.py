"""compatible_with's matrix on hand-made namespaces (no engine needed)."""

from __future__ import annotations

import dataclasses

import pytest

from edgesync_engines.adapters.compat import COMPATIBLE, CONVERTIBLE, INCOMPATIBLE, compatible_with
from edgesync_engines.adapters.llamacpp import LAYOUT as LLAMA_LAYOUT
from edgesync_engines.adapters.onnxrt import LAYOUT as ONNX_LAYOUT
from edgesync_store.schema import Namespace

LLAMA = Namespace(
    "a" * 64, "llama.cpp", "llama-cpp-python 0.3.36", "f16", False, LLAMA_LAYOUT + ";v_trans=1", 30, 3, 64
)
ONNX = Namespace("a" * 64, "onnxruntime", "onnxruntime 1.32.0; v1", "f32", False, ONNX_LAYOUT, 30, 3, 64)


@pytest.mark.parametrize("a, b, verdict, reason", [
    (LLAMA, LLAMA, COMPATIBLE, "same engine"),
    (ONNX, ONNX, COMPATIBLE, "same engine"),
    (LLAMA, ONNX, CONVERTIBLE, "K rotary pairs interleaved -> rotate-half"),
    (ONNX, LLAMA, CONVERTIBLE, "K rotary pairs rotate-half -> interleaved"),
    (LLAMA, dataclasses.replace(LLAMA, flash_attn=True), CONVERTIBLE, "flash_attn False -> True"),
    (LLAMA, dataclasses.replace(LLAMA, engine_version="llama-cpp-python 0.3.37"), CONVERTIBLE, "engine_version"),
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
