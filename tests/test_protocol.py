"""Both real engines satisfy the one adapter interface (edgesync_engines/adapters/protocol.py):
llama.cpp on the real SmolLM2 GGUF and ONNX Runtime on its real export. Every interface member
exists with a compatible signature and type hints, and returns what the interface says (types,
shapes, dtypes, errors); the request path uses no adapter member the interface leaves out; an
object that does not subclass ``EngineAdapter`` is one when it has the members."""

from __future__ import annotations

import ast
import codecs
import dataclasses
import inspect
import threading
import typing
from pathlib import Path

import numpy as np
import pytest
from fake_adapter import FakeAdapter

from edgesync_engines.adapters import protocol
from edgesync_engines.adapters.kv_layout import usable_prefix
from edgesync_engines.adapters.protocol import ContextOverflowError, EngineAdapter, missing_members, protocol_members
from edgesync_store.schema import KVFragment, Namespace

REPO = Path(__file__).resolve().parent.parent
DATA = {"namespace": Namespace, "cache_refusal": type(None), "blend_refusal": (type(None), str), "n_ctx": int,
        "model_path": Path, "kv_epoch": int}
"""The protocol's data attributes and their types on SmolLM2, whose KV both engines cut
(``cache_refusal`` None; ``blend_refusal`` None for llama.cpp, a reason for ONNX Runtime;
``lock`` is checked apart: an RLock)."""
PROPERTIES = {"closed"}
METHODS = ["tokenize", "apply_chat_template", "token_bytes", "text_stream", "usable_prefix",
           "extract_fragments", "inject_fragment", "stage_fragment", "generate", "prefill",
           "prefill_batches", "extend", "live_tokens", "place_kv", "recompute",
           "clear_kv_cache", "warm_up", "make_room", "abortable", "set_threads", "close",
           "slot_adapters"]
MESSAGES = [{"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "Why do caches make repeated prompts faster? " * 12}]


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.fixture(params=["llama.cpp", "onnxruntime"])
def engine(request):
    """Each real adapter in turn (session-wide instances, so the model loads once)."""
    return request.getfixturevalue("adapter" if request.param == "llama.cpp" else "onnx_adapter")


def test_the_protocol_declares_exactly_these_members():
    assert set(protocol_members()) == set(DATA) | {"lock"} | PROPERTIES | set(METHODS)
    declared = set(EngineAdapter.__annotations__) | set(vars(EngineAdapter))
    assert set(protocol_members()) <= declared  # each member is declared on the ABC itself


def test_an_object_with_the_members_is_an_engine_adapter_without_subclassing():
    fake = FakeAdapter()
    assert isinstance(fake, EngineAdapter) and missing_members(fake) == []
    assert EngineAdapter not in type(fake).__mro__

    class Partial:
        def tokenize(self, text):
            return []

    assert not isinstance(Partial(), EngineAdapter)
    assert "generate" in missing_members(Partial()) and "tokenize" not in missing_members(Partial())
    with pytest.raises(TypeError, match="abstract"):
        EngineAdapter()


@pytest.mark.model
def test_both_engines_are_engine_adapters(engine):
    assert isinstance(engine, EngineAdapter) and missing_members(engine) == []
    assert not isinstance(object(), EngineAdapter)  # the check does look at the members
    assert missing_members(object()) == protocol_members()


@pytest.mark.model
def test_data_attributes_and_properties_have_the_declared_types(engine):
    for name, kind in DATA.items():
        assert isinstance(getattr(engine, name), kind), name
    assert isinstance(engine.lock, type(threading.RLock()))
    assert engine.model_path.is_file() and engine.model_path.suffix == ".gguf"
    assert engine.n_ctx == 4096
    assert isinstance(inspect.getattr_static(type(engine), "closed"), property)
    assert engine.closed is False
    ns = engine.namespace
    assert (ns.n_layer, ns.n_head_kv, ns.head_dim) == (30, 3, 64)  # SmolLM2-135M
    assert ns.engine == {"LlamaCppAdapter": "llama.cpp", "OnnxRuntimeAdapter": "onnxruntime"}[type(engine).__name__]


@pytest.mark.model
@pytest.mark.parametrize("name", METHODS)
def test_methods_have_the_protocols_signature_and_type_hints(engine, name):
    declared = inspect.signature(getattr(EngineAdapter, name))
    params = list(declared.parameters.values())[1:]  # without self
    actual = list(inspect.signature(getattr(engine, name)).parameters.values())
    assert [(p.name, p.kind, p.default) for p in actual[: len(params)]] == [(p.name, p.kind, p.default) for p in params]
    assert all(p.default is not inspect.Parameter.empty for p in actual[len(params):]), actual
    want = typing.get_type_hints(getattr(EngineAdapter, name))
    got = typing.get_type_hints(getattr(type(engine), name))
    assert {k: got.get(k) for k in want} == want


@pytest.mark.model
def test_text_members_return_what_the_protocol_says(engine):
    text = engine.apply_chat_template(MESSAGES)
    assert isinstance(text, str) and text.startswith("<|im_start|>system\nYou answer")
    assert text.endswith("<|im_start|>assistant\n")
    tokens = engine.tokenize(text)
    assert isinstance(tokens, list) and all(type(t) is int for t in tokens) and len(tokens) == 130
    plain = "naïve café, 日本語のテキスト 🙂🚀 and  spaces"
    pieces = [engine.token_bytes(t) for t in engine.tokenize(plain)]
    assert all(isinstance(p, bytes) for p in pieces)
    assert any(len(p) and not _decodes(p) for p in pieces)  # some token holds part of a character
    decoder = engine.text_stream()
    assert isinstance(decoder, codecs.IncrementalDecoder)
    assert "".join(decoder.decode(p) for p in pieces) == plain
    assert engine.text_stream() is not decoder  # a fresh decoder each time
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        engine.apply_chat_template([{"role": "user"}])


@pytest.mark.model
def test_kv_members_return_what_the_protocol_says(engine):
    tokens = engine.tokenize(engine.apply_chat_template(MESSAGES))
    n = len(tokens)
    for available in (0, 64, n - 2, n - 1, n + 5):
        usable = engine.usable_prefix(available, n)
        assert type(usable) is int and 0 <= usable <= min(available, n - 1)
    assert engine.usable_prefix(n, n) in (n - 1, n - 2)

    with engine.lock:
        first = list(engine.generate(tokens, 0, 4))
        assert 1 <= len(first) <= 4 and all(type(t) is int for t in first)
        frags = engine.extract_fragments(tokens, [(0, 64), (64, 128)], ttl_seconds=60.0, now=1000.0,
                                         layer_start=1, layer_stride=2, head_start=1)
        assert [(f.token_start, f.token_end) for f in frags] == [(0, 64), (64, 128)]
        ns = engine.namespace
        for f in frags:
            assert isinstance(f, KVFragment) and f.namespace == ns
            span = f.token_end - f.token_start
            for arr in (f.keys, f.values):
                assert arr.dtype == ns.np_dtype and arr.flags.c_contiguous
                assert arr.shape == (15, span, 2 * ns.head_dim)  # layers 1, 3, ..., 29; heads 1-2
            assert f.token_ids.dtype == np.int32 and list(f.token_ids) == tokens[f.token_start:f.token_end]
            assert (f.created_at, f.expires_at) == (1000.0, 1060.0)
        assert engine.extract_fragments(tokens, []) == []
        with pytest.raises(ValueError, match="token_end"):
            engine.extract_fragments(tokens, [(0, n + 64)])

        whole = engine.extract_fragments(tokens, [(0, 64), (64, 128)])
        target = engine.usable_prefix(128, n)
        # llama.cpp: an injection point a prefill after it computes as an uncached one does
        expected = (usable_prefix(128, n, int(engine.llm.n_batch), engine.injection_rule) if ns.engine == "llama.cpp"
                    else 128)
        assert target == expected and 0 < target <= 128  # see usable_prefix
        engine.clear_kv_cache()
        assert engine.inject_fragment(whole, target, tokens) == target
        again = list(engine.generate(tokens, target, 4))
        assert again == first  # the injected KV continues like the uncached run
        with pytest.raises(ValueError, match="namespace"):
            other = dataclasses.replace(ns, model_fingerprint="0" * 64)
            engine.inject_fragment([KVFragment(
                namespace=other, token_start=0, token_end=64, layer_start=0, layer_end=ns.n_layer,
                keys=whole[0].keys, values=whole[0].values, token_ids=whole[0].token_ids,
                prefix_hash=whole[0].prefix_hash)], 64, tokens)
        with pytest.raises(ContextOverflowError) as overflow:
            next(engine.generate(tokens, 0, engine.n_ctx))
        assert (overflow.value.prompt_tokens, overflow.value.n_ctx) == (n, engine.n_ctx)
        with pytest.raises(ValueError, match="n_past"):
            next(engine.generate(tokens, n, 4))
        engine.clear_kv_cache()
        with pytest.raises(ValueError, match="n_past"):
            next(engine.generate(tokens, 64, 4))  # the cleared cache does not hold them


@pytest.mark.model
def test_warm_up_leaves_the_engine_as_a_fresh_load(engine):
    """``warm_up`` evaluates and renders, then leaves an empty cache: an answer after it equals
    the one before, the cleared cache holds nothing (continuing at n_past raises), and on
    llama.cpp the warm-up's own evaluation is not in the counters and the seq-state buffer it
    faulted in is what the next injection of that size writes into (no new allocation)."""
    tokens = engine.tokenize(engine.apply_chat_template(MESSAGES))
    before = list(engine.generate(tokens, 0, 6))
    engine.warm_up(len(tokens))
    with pytest.raises(ValueError, match="n_past"):
        next(engine.generate(tokens, 64, 4))
    if engine.namespace.engine == "llama.cpp":
        assert engine.perf_counts()["n_p_eval"] <= 1 and engine.perf_counts()["n_eval"] <= 1  # 0 shows as 1
        assert list(engine.generate(tokens, 0, 6)) == before
        whole = engine.extract_fragments(tokens, [(0, 64), (64, 128)])
        engine.clear_kv_cache()
        buf = engine._state_buf  # the buffer the warm-up faulted in, sized for the whole prompt
        assert engine.inject_fragment(whole, 128, tokens) == 128 and engine._state_buf is buf
    assert list(engine.generate(tokens, 0, 6)) == before


def test_the_request_path_uses_only_protocol_members():
    """Every ``<x>.adapter.<name>`` / ``adapter.<name>`` in the request path and the app is a
    protocol member."""
    used: dict[str, str] = {}
    for path in sorted((REPO / "edgesync_engines").glob("request/**/*.py")) + sorted(
            (REPO / "edgesync_engines").glob("app/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                owner = node.value
                named = (isinstance(owner, ast.Name) and owner.id == "adapter") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "adapter")
                if named:
                    used.setdefault(node.attr, f"{path.relative_to(REPO)}:{node.lineno}")
    assert used, "no adapter use found: has the request path renamed its adapter?"
    extra = {name: where for name, where in used.items() if name not in protocol_members()}
    assert not extra, f"adapter members used but not in protocol.EngineAdapter: {extra}"


def test_the_errors_keep_their_names_and_bases():
    assert issubclass(protocol.ContextOverflowError, ValueError)
    assert issubclass(protocol.InjectionError, RuntimeError)
    err = ContextOverflowError(4000, 200, 4096)
    assert (err.prompt_tokens, err.max_tokens, err.n_ctx) == (4000, 200, 4096)
    assert "4200 tokens does not fit the context of 4096" in str(err)
