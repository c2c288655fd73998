"""Shared test material: a namespace with SmolLM2's KV geometry (30 layers, 3 KV heads of 64,
f16), for tests of the store, codec and schema that need no model."""

from __future__ import annotations

from edgesync_store.schema import Namespace

SMOL = Namespace(
    model_fingerprint="ab" * 32,
    engine="llama.cpp",
    engine_version="llama-cpp-python 0.3.36",
    kv_dtype="f16",
    flash_attn=False,
    layout="test",
    n_layer=30,
    n_head_kv=3,
    head_dim=64,
    kernels="test",
)
