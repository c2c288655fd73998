"""KV across engines on the real SmolLM2 (llama.cpp on the GGUF, ONNX Runtime on its export):
conversion both ways, compatible_with's refusals, and the router's opt-in convertible reuse."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tinymodel import N_HEAD_KV, build_tiny_export

from edgesync_engines.adapters.compat import CONVERTIBLE, INCOMPATIBLE, compatible_with
from edgesync_engines.adapters.onnx_export import TOKENIZER_FILE, read_meta
from edgesync_engines.adapters.onnxrt import OnnxRuntimeAdapter
from edgesync_engines.adapters.reshape import can_inject_with_reshape, convert_fragment
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore

pytestmark = [pytest.mark.model]

PREFIX, TOTAL = 128, 200
MAX_TOKENS = 8
"""Tokens generated where an answer is compared with an uncached one (the length is not what
these tests are about)."""


@pytest.fixture(scope="module")
def doc_prompts(onnx_adapter, data_dir):
    """200-token prompts: the first eight doc-QA contexts (real SQuAD text) that long."""
    rows = [json.loads(line) for line in (data_dir / "doc_qa.jsonl").read_text().splitlines()]
    out = [t[:TOTAL] for t in (onnx_adapter.tokenize(row["context"]) for row in rows) if len(t) >= TOTAL][:8]
    assert len(out) == 8
    return out


@pytest.fixture(scope="module")
def router_messages(seed_requests):
    """Seed requests 3-5 as chat messages: the prompts the router tests send."""
    return [r.as_messages() for r in seed_requests[3:6]]


@pytest.fixture(scope="module")
def uncached_answers(adapter, onnx_adapter, router_messages):
    """Each engine's uncached answer (MAX_TOKENS) to every router_messages prompt, by
    ``namespace.engine``: computed once, what the router tests' answers must equal."""
    return {a.namespace.engine: [EdgeSync(a, store=False).generate(m, max_tokens=MAX_TOKENS) for m in router_messages]
            for a in (adapter, onnx_adapter)}


def llama_logits(llama, tokens, n_past=0, fragments=None):
    """llama.cpp logits [len(tokens) - n_past, vocab] of one batch after ``fragments`` (or a
    clean prefill when None)."""
    llama.clear_kv_cache()
    if fragments is not None:
        llama.inject_fragment(fragments, n_past, tokens)
    llama.llm.eval(tokens[n_past:])
    return np.array(llama.llm.scores[n_past : len(tokens)], dtype=np.float32)


def test_fragments_converted_both_ways_agree_with_the_receiving_engine(onnx_adapter, llama_all_logits, doc_prompts):
    """Acceptance 2: 128 tokens of llama.cpp KV injected into ONNX Runtime and 128 of ONNX
    Runtime KV injected into llama.cpp; the 72 suffix positions' argmax agrees with the
    receiving engine's own clean prefill at >= 95% of positions, over eight real prompts."""
    llama = llama_all_logits
    agree = {"llama.cpp->onnx": [], "onnx->llama.cpp": []}
    for tokens in doc_prompts:
        own_ort = onnx_adapter.eval_logits(tokens)[PREFIX:]
        ort_fragment = onnx_adapter.extract_fragment(tokens, 0, PREFIX)
        own_llama = llama_logits(llama, tokens)[PREFIX:]
        llama_fragment = llama.extract_fragment(tokens, 0, PREFIX)
        assert compatible_with(llama_fragment, onnx_adapter).verdict == CONVERTIBLE
        assert can_inject_with_reshape(llama_fragment, onnx_adapter) and can_inject_with_reshape(ort_fragment, llama)

        onnx_adapter.clear_kv_cache()
        onnx_adapter.inject_fragment([convert_fragment(llama_fragment, onnx_adapter.namespace)], PREFIX, tokens)
        into_ort = onnx_adapter.eval_logits(tokens, PREFIX)
        into_llama = llama_logits(llama, tokens, PREFIX, [convert_fragment(ort_fragment, llama.namespace)])
        agree["llama.cpp->onnx"] += list(into_ort.argmax(1) == own_ort.argmax(1))
        agree["onnx->llama.cpp"] += list(into_llama.argmax(1) == own_llama.argmax(1))
        # the conversion is not a no-op: unconverted K (rotary pairs in the wrong order) is far off
        raw = convert_fragment(llama_fragment, onnx_adapter.namespace)
        raw.keys[:] = llama_fragment.keys.astype(np.float32)
        onnx_adapter.clear_kv_cache()
        onnx_adapter.inject_fragment([raw], PREFIX, tokens)
        wrong = onnx_adapter.eval_logits(tokens, PREFIX)
        assert np.abs(wrong - own_ort).mean() > 2 * np.abs(into_ort - own_ort).mean()
    for direction, hits in agree.items():
        assert len(hits) == 8 * (TOTAL - PREFIX)
        assert np.mean(hits) >= 0.95, (direction, np.mean(hits))


def test_llama_cpp_kv_survives_the_round_trip_through_onnx_layout_bit_for_bit(adapter, doc_prompts):
    adapter.clear_kv_cache()
    list(adapter.generate(doc_prompts[0], max_tokens=1))
    fragment = adapter.extract_fragment(doc_prompts[0], 0, PREFIX)
    import dataclasses

    from edgesync_engines.adapters.onnxrt import ENGINE, LAYOUT

    onnx_ns = dataclasses.replace(adapter.namespace, engine=ENGINE, engine_version="x", kv_dtype="f32", layout=LAYOUT)
    there = convert_fragment(fragment, onnx_ns)
    back = convert_fragment(there, adapter.namespace)
    assert there.keys.dtype == np.float32 and not np.array_equal(there.keys, fragment.keys.astype(np.float32))
    assert np.array_equal(there.values, fragment.values.astype(np.float32))
    assert back.keys.dtype == np.float16 and np.array_equal(back.keys, fragment.keys)
    assert np.array_equal(back.values, fragment.values) and back.key() == fragment.key()


@pytest.fixture(scope="module")
def tiny_exports(onnx_export, adapter, tmp_path_factory):
    """Two tiny random models with 2 KV heads of 16: one of its own, one whose export claims
    the real GGUF's fingerprint (same model, another head layout)."""
    root = tmp_path_factory.mktemp("tiny")
    template = read_meta(onnx_export)["chat_template"]
    own = build_tiny_export(root / "own", onnx_export / TOKENIZER_FILE, template)
    forged = build_tiny_export(root / "forged", onnx_export / TOKENIZER_FILE, template,
                               source_fingerprint=adapter.namespace.model_fingerprint)
    return own, forged


@pytest.fixture(scope="module")
def foreign_store(tiny_exports, router_messages, tmp_path_factory):
    """A store that only the two tiny models (tiny_exports order) wrote to, each through the
    router answering router_messages[0], and their namespaces. Tests copy it: they write to it."""
    store_dir = tmp_path_factory.mktemp("foreign") / "store"
    namespaces = []
    for export in tiny_exports:
        tiny = OnnxRuntimeAdapter(export=export, n_threads=1)
        try:
            assert tiny.namespace.n_head_kv == N_HEAD_KV
            with EdgeSync(tiny, store=store_dir, config=EdgeSyncConfig.load({"semantic": False, "jobs": False})) as es:
                assert es.generate(router_messages[0], max_tokens=4).fragments_written >= 1
            namespaces.append(tiny.namespace)
        finally:
            tiny.close()
    return store_dir, namespaces


@pytest.mark.parametrize("engine", ["llamacpp", "onnx"])
def test_another_models_fragments_are_refused_and_the_router_prefills(engine, foreign_store, adapter, onnx_adapter,
                                                                      router_messages, uncached_answers, tmp_path):
    """Acceptance 3: fragments of another model (a tiny llama with 2 KV heads) for the very
    prompt asked are in the store; compatible_with refuses them, so the router (convertible
    reuse allowed) prefills and answers exactly as uncached."""
    receiver = adapter if engine == "llamacpp" else onnx_adapter
    messages = router_messages[0]
    tokens = receiver.tokenize(receiver.apply_chat_template(messages))
    store_dir = tmp_path / "store"
    shutil.copytree(foreign_store[0], store_dir)
    foreign = foreign_store[1]
    for namespace, reason in zip(foreign, ("another model", "another head layout")):
        with FragmentStore(store_dir) as store:
            walk = store.prefix_walk(namespace, tokens)
            assert walk.matched_tokens >= 128
            fragment = store.get(walk.spans[0].keys[0])
        verdict = compatible_with(fragment, receiver)
        assert verdict.verdict == INCOMPATIBLE and reason in verdict.reason, verdict
        assert not can_inject_with_reshape(fragment, receiver)
        with pytest.raises(ValueError, match=reason):
            convert_fragment(fragment, receiver.namespace)
    cfg = EdgeSyncConfig.load({"semantic": False, "jobs": False, "allow_convertible": True})
    want = uncached_answers[receiver.namespace.engine][0]
    with EdgeSync(receiver, store=store_dir, config=cfg) as es:
        assert set(foreign) <= set(es.store.namespaces())
        got = es.generate(messages, max_tokens=MAX_TOKENS)
    assert got.hit == "miss" and got.tokens_reused == 0 and not got.convertible
    assert got.tokens == want.tokens
    assert got.fragments_written >= 1  # its own KV, stored as usual


def test_router_uses_the_other_engines_kv_only_when_allowed(adapter, onnx_adapter, router_messages, uncached_answers,
                                                            tmp_path):
    """llama.cpp fills the store; ONNX Runtime misses on it by default (token-identical
    output, its own fragments written) and, with allow_convertible, injects the converted
    chain: convertible and source_engine reported, nothing written, output reported against
    uncached (its first token checked). Then the other direction."""
    msgs = router_messages
    base = {"semantic": False, "jobs": False}
    for writer, reader in ((adapter, onnx_adapter), (onnx_adapter, adapter)):
        store_dir = tmp_path / f"store-{writer.namespace.engine}"
        with EdgeSync(writer, store=store_dir, config=EdgeSyncConfig.load(base)) as es:
            for m in msgs:
                es.generate(m, max_tokens=4)
        uncached = uncached_answers[reader.namespace.engine]
        with EdgeSync(reader, store=store_dir, config=EdgeSyncConfig.load({**base, "allow_convertible": True})) as es:
            # a few decode steps on the converted KV, though only the first token is compared
            converted = [es.generate(m, max_tokens=4) for m in msgs]
        for got, want in zip(converted, uncached):
            assert got.convertible and got.source_engine == writer.namespace.engine
            assert got.hit == "exact" and got.tokens_prefilled == 1 and got.fragments_written == 0
            assert got.tokens[:1] == want.tokens[:1]
        with FragmentStore(store_dir) as store:
            assert [ns.engine for ns in store.namespaces()] == [writer.namespace.engine]
        with EdgeSync(reader, store=store_dir, config=EdgeSyncConfig.load(base)) as es:
            plain = [es.generate(m, max_tokens=MAX_TOKENS) for m in msgs]
        assert all(p.hit == "miss" and not p.convertible and p.fragments_written >= 1 for p in plain)
        assert [p.tokens for p in plain] == [u.tokens for u in uncached]
        # forget removes every engine's copy: with convertible reuse allowed it is a miss too
        with EdgeSync(reader, store=store_dir, config=EdgeSyncConfig.load({**base, "allow_convertible": True})) as es:
            before = es.store.stats().fragments
            removed = es.forget(msgs[0])
            assert removed >= 2 and es.store.stats().fragments == before - removed
            again = es.generate(msgs[0], max_tokens=4)
            assert again.hit == "miss" and not again.convertible


def test_run_command_reports_cross_engine_hits(tmp_path):
    """Acceptance 4, small: `edgesync run --engine onnx --allow-convertible` on a store that
    `edgesync run` (llama.cpp) filled reports the cross-engine hits and their agreement."""
    store = tmp_path / "store"
    env = {**os.environ, "EDGESYNC_THREADS": "2", "EDGESYNC_JOBS": "0"}
    common = ["run", "seed", "--limit", "3", "--max-tokens", "4", "--store", str(store), "--json"]
    first = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", *common], capture_output=True, text=True,
                           env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "edgesync_engines.app.cli", *common, "--engine", "onnx",
                           "--allow-convertible"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["engine"] == "onnx" and doc["allow_convertible"] is True
    summary = doc["summary"]["edgesync"]
    rows = doc["requests"]
    assert summary["convertible"] == sum(r["convertible"] for r in rows) >= 1
    assert all(r["source_engine"] == "llama.cpp" for r in rows if r["convertible"])
    assert summary["convertible_identical_share"] == pytest.approx(
        sum(r["identical"] for r in rows if r["convertible"]) / summary["convertible"])
    assert 0.0 <= summary["convertible_agreement_mean"] <= 1.0
