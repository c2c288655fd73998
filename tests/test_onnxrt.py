"""The ONNX Runtime engine on the real SmolLM2 export (edgesync export-onnx of the same GGUF
llama.cpp runs): tokenization, KV injection, generation, and the export's metadata."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from edgesync_engines.adapters.model_files import file_fingerprint
from edgesync_engines.adapters.onnx_export import META_FILE, MODEL_FILE, TOKENIZER_FILE, ExportError, read_meta
from edgesync_engines.adapters.onnxrt import OnnxRuntimeAdapter
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore
from edgesync_store.schema import chunk_spans

pytestmark = [pytest.mark.model]


def decode_steps(generated: list[int], max_tokens: int) -> int:
    """Tokens a generation evaluated after the prompt: every generated token, but the last
    one when max_tokens (not an end-of-generation token) stopped it."""
    return len(generated) - (len(generated) == max_tokens)


@pytest.fixture(scope="module")
def doc_tokens(onnx_adapter, data_dir):
    """Token IDs of the first six doc-QA contexts (real SQuAD text) of 256 tokens or more."""
    rows = [json.loads(line) for line in (data_dir / "doc_qa.jsonl").read_text().splitlines()]
    out = [t for t in (onnx_adapter.tokenize(row["context"]) for row in rows) if len(t) >= 256][:6]
    assert len(out) == 6
    return out


def test_tokenize_gives_llama_cpp_token_ids(onnx_adapter, adapter, data_dir, system_prompts, seed_requests):
    texts = list(system_prompts)
    texts += [json.loads(line)["context"] for line in (data_dir / "doc_qa.jsonl").read_text().splitlines()[:20]]
    texts += [adapter.apply_chat_template(req.as_messages()) for req in seed_requests[:60]]
    texts += [
        "naïve café — 日本語のテキスト 🙂🚀 tabs\tand\nnewlines  double  spaces",
        "<|im_start|>user\nhi<|im_end|>\n",
        " ",
    ]
    for text in texts:
        assert onnx_adapter.tokenize(text) == adapter.tokenize(text), text[:80]
    messages = seed_requests[0].as_messages()
    assert onnx_adapter.apply_chat_template(messages) == adapter.apply_chat_template(messages)
    ids = adapter.tokenize(texts[-2 - 1])
    assert b"".join(onnx_adapter.token_bytes(t) for t in ids) == b"".join(adapter.token_bytes(t) for t in ids)


def test_injecting_128_of_200_tokens_matches_a_full_prefill(onnx_adapter, doc_tokens, tmp_path):
    """Acceptance 1: KV of the first 128 tokens (a clean 128-token prefill, stored in a real
    LMDB store and read back) injected, the other 72 prefilled: logits within 1e-4 of a clean
    200-token prefill, the same argmax at every position."""
    with FragmentStore(tmp_path / "store") as store:
        for tokens in doc_tokens[:3]:
            tokens = tokens[:200]
            full = onnx_adapter.eval_logits(tokens)
            onnx_adapter.eval_logits(tokens[:128])
            fragment = onnx_adapter.extract_fragment(tokens, 0, 128)
            assert fragment.keys.dtype == np.float32 and fragment.keys.shape == (30, 128, 3 * 64)
            assert store.put(fragment)
            stored = store.get(fragment.key())
            onnx_adapter.clear_kv_cache()
            assert onnx_adapter.inject_fragment([stored], 128, tokens) == 128
            before = onnx_adapter.tokens_evaluated
            suffix = onnx_adapter.eval_logits(tokens, 128)
            assert onnx_adapter.tokens_evaluated - before == 72
            assert suffix.shape == (72, full.shape[1])
            assert np.abs(suffix - full[128:]).max() <= 1e-4
            assert np.array_equal(suffix.argmax(axis=1), full[128:].argmax(axis=1))


def test_extract_inject_round_trip_is_lossless(onnx_adapter, doc_tokens):
    tokens = doc_tokens[3][:256]
    onnx_adapter.eval_logits(tokens)
    live = [p.copy() for p in onnx_adapter._past]
    parts = onnx_adapter.extract_fragments(tokens, chunk_spans(256, 128))
    layers = [
        onnx_adapter.extract_fragment(tokens, 0, 128, 0, 15),
        onnx_adapter.extract_fragment(tokens, 0, 128, 15, 30),
    ]
    heads = onnx_adapter.extract_fragments(tokens, [(128, 256)], head_start=0, head_end=1) + \
        onnx_adapter.extract_fragments(tokens, [(128, 256)], head_start=1, head_end=3)
    for fragments in (parts, layers + heads):
        onnx_adapter.clear_kv_cache()
        onnx_adapter.inject_fragment(fragments, 256, tokens)
        assert all(np.array_equal(a, b) for a, b in zip(onnx_adapter._past, live))
    with pytest.raises(ValueError, match="no KV for layer"):
        onnx_adapter.inject_fragment(layers[:1], 128, tokens)
    with pytest.raises(ValueError, match="differs from the prompt"):
        onnx_adapter.inject_fragment(parts, 200, tokens[:100] + [0] * 156)
    with pytest.raises(ValueError, match="token_end"):
        onnx_adapter.extract_fragment(tokens, 0, 300)


def test_generate_is_greedy_by_default_and_seeded_when_sampling(onnx_adapter, adapter, seed_requests):
    tokens = onnx_adapter.tokenize(onnx_adapter.apply_chat_template(seed_requests[1].as_messages()))
    greedy = list(onnx_adapter.generate(tokens, max_tokens=12))
    assert greedy == list(onnx_adapter.generate(tokens, max_tokens=12))
    assert len(greedy) <= 12 and not any(onnx_adapter.is_eog(t) for t in greedy)
    onnx_adapter.clear_kv_cache()
    onnx_adapter.eval_logits(tokens)
    assert greedy[0] == int(np.argmax(onnx_adapter._logits))
    hot = [list(onnx_adapter.generate(tokens, max_tokens=12, temperature=1.5, top_p=0.95, seed=s)) for s in (1, 1, 2)]
    assert hot[0] == hot[1] and hot[0] != greedy
    assert list(onnx_adapter.generate(tokens, max_tokens=1)) == greedy[:1]
    # continuing from the live KV (the previous answer's cells beyond n_past are dropped) at a
    # batch boundary makes the uncached run's calls again: the same answer
    assert len(tokens) > 129
    list(onnx_adapter.generate(tokens, max_tokens=5))
    before = onnx_adapter.tokens_evaluated
    assert list(onnx_adapter.generate(tokens, n_past=128, max_tokens=12)) == greedy
    assert onnx_adapter.tokens_evaluated - before == len(tokens) - 128 + decode_steps(greedy, 12)
    with pytest.raises(ValueError, match="n_past"):
        list(onnx_adapter.generate([t + 1 for t in tokens], n_past=128, max_tokens=2))


def test_router_on_onnx_runtime_reuses_its_own_kv_token_identically(onnx_adapter, seed_requests, tmp_path):
    """ORT writes and reads its own float32 fragments: a repeat is exact (one token
    evaluated), a shared system prompt a partial hit, every output equal to uncached."""
    baseline = EdgeSync(onnx_adapter, store=False)
    reqs = [r for r in seed_requests[:40]]
    by_system: dict[str, list] = {}
    for r in reqs:
        by_system.setdefault(r.as_messages()[0]["content"], []).append(r)
    first, second = next(v for v in by_system.values() if len({x.as_messages()[-1]["content"] for x in v}) >= 2)[:2]
    with EdgeSync(onnx_adapter, store=tmp_path / "store") as es:
        results = []
        for req in (first, first, second):
            want = baseline.generate(req.as_messages(), max_tokens=8)
            before = onnx_adapter.tokens_evaluated
            got = es.generate(req.as_messages(), max_tokens=8)
            evaluated = onnx_adapter.tokens_evaluated - before
            assert got.tokens == want.tokens
            results.append((got, evaluated))
        (miss, n0), (exact, n1), (partial, n2) = results
        assert miss.hit == "miss" and miss.fragments_written >= 1
        assert exact.hit == "exact" and exact.tokens_prefilled == 1
        assert n1 == 1 + decode_steps(exact.tokens, 8)  # the last prompt token, then decode steps
        assert partial.hit == "partial" and partial.tokens_reused >= 128
        assert n2 == partial.tokens_prefilled + decode_steps(partial.tokens, 8)
        assert {ns.engine for ns in es.store.namespaces()} == {"onnxruntime"}
        assert not miss.convertible and exact.source_engine == "onnxruntime"


def test_export_records_the_gguf_fingerprint(onnx_export, onnx_adapter):
    import onnxruntime as ort

    from edgesync_engines.adapters.model_files import default_model_path

    fingerprint = file_fingerprint(default_model_path())
    props = ort.InferenceSession(str(onnx_export / MODEL_FILE), providers=["CPUExecutionProvider"]) \
        .get_modelmeta().custom_metadata_map
    assert props["edgesync.source_fingerprint"] == fingerprint
    assert read_meta(onnx_export)["source_fingerprint"] == fingerprint
    assert onnx_adapter.namespace.model_fingerprint == fingerprint
    assert (onnx_adapter.namespace.n_layer, onnx_adapter.namespace.n_head_kv, onnx_adapter.namespace.head_dim) == (
        30,
        3,
        64,
    )


def test_an_export_of_another_file_or_an_incomplete_one_is_refused(onnx_export, tmp_path, monkeypatch):
    from edgesync_engines.adapters.model_files import default_model_path

    fake = tmp_path / "onnx" / onnx_export.name
    fake.mkdir(parents=True)
    for name in (MODEL_FILE, MODEL_FILE + ".data", TOKENIZER_FILE):
        (fake / name).symlink_to(onnx_export / name)
    meta = json.loads((onnx_export / META_FILE).read_text())
    (fake / META_FILE).write_text(json.dumps({**meta, "source_fingerprint": "0" * 64}))
    monkeypatch.setenv("EDGESYNC_ONNX_DIR", str(tmp_path / "onnx"))
    with pytest.raises(ExportError, match="exported from another file"):
        OnnxRuntimeAdapter(default_model_path())
    (fake / TOKENIZER_FILE).unlink()
    with pytest.raises(ExportError, match="tokenizer.json missing"):
        OnnxRuntimeAdapter(default_model_path())
    shutil.rmtree(fake)
    with pytest.raises(ExportError, match="run `edgesync export-onnx`"):
        OnnxRuntimeAdapter(default_model_path())


def test_streamed_answer_is_the_result_text_and_a_closed_engine_refuses(onnx_export, seed_requests):
    adapter = OnnxRuntimeAdapter()
    es = EdgeSync(adapter, store=False)
    stream = es.generate(seed_requests[4].as_messages(), max_tokens=10, stream=True)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text and len(stream.result.tokens) >= 1
    assert stream.result.text == adapter.detokenize(stream.result.tokens)
    es.close()
    assert not adapter.closed  # an adapter passed in belongs to the caller
    adapter.close()
    with pytest.raises(RuntimeError, match="closed"):
        es.generate("hello there", max_tokens=2)
