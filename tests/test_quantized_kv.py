"""q8_0 KV (``LlamaCppAdapter(kv_type="q8_0")``, flash attention on) on the real SmolLM2 and
Gemma 3 270M: a miss, then exact and partial hits at several cut points, each answer's greedy
tokens identical to an uncached run of the same adapter; fragments hold q8_0 rows (34 bytes per
32 values) and are exactly 34/64 of the f16 fragments of the same prompt; the f16 and q8_0
namespaces differ, so neither store serves the other.

With flash attention the last-token logits of a cached and an uncached run may differ in their
last bits at some cut points (measured on Gemma 3), so these tests compare greedy TOKENS, on
several prompts. Prompts are real text: app system prompts of ../shared/workloads joined, then a
question (for Gemma a prompt over 900 tokens, beyond its 512-token window).
"""

from __future__ import annotations

import numpy as np
import pytest

from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.adapters.model_files import default_model_path, gemma3_model_path
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore
from edgesync_store.schema import common_prefix_len

pytestmark = [pytest.mark.model]

N_CTX = 2048
MAX_TOKENS = 12
Q8_0_BLOCK = (32, 34)
"""q8_0: 32 values in 34 bytes (ggml-common.h ``block_q8_0``: an f16 scale and 32 int8)."""
QUESTIONS = ("How do I improve my English?", "What should I pack for a week of hiking in the rain?",
             "Give me one tip for each of these apps.")
MODELS = ("smollm2", "gemma3")


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _path(model: str):
    return default_model_path() if model == "smollm2" else gemma3_model_path()


@pytest.fixture(scope="module")
def q8(request):
    """One q8_0-KV adapter per model, loaded on first use."""
    adapters = {}

    def get(model: str) -> LlamaCppAdapter:
        if model not in adapters:
            adapters[model] = LlamaCppAdapter(_path(model), n_ctx=N_CTX, kv_type="q8_0")
        return adapters[model]

    yield get
    for a in adapters.values():
        a.close()


def _prompts(system_prompts, model: str) -> list[list[dict]]:
    """Requests in the order sent: three system prompts + a question (stored by the miss),
    the same (exact), then prompts sharing the first 3, 2 and 1 system prompts with it
    (partial hits cut at three depths). Gemma 3 gets the whole system prompts (over 900 tokens,
    beyond its 512-token window); SmolLM2, which has no window, the first half of each
    (about 500 tokens: the same three cut depths, for half the prefill)."""
    if model != "gemma3":
        system_prompts = [" ".join(p.split(" ")[: len(p.split(" ")) // 2]) for p in system_prompts]
    three = "\n\n".join(system_prompts[:3])
    return [
        chat(three, QUESTIONS[0]),
        chat(three, QUESTIONS[0]),
        chat(three, QUESTIONS[1]),
        chat("\n\n".join(system_prompts[:2]), QUESTIONS[2]),
        chat(system_prompts[0], QUESTIONS[1]),
    ]


def test_q8_0_hits_match_uncached_q8_0(q8, system_prompts, tmp_path):
    """SmolLM2 (Gemma 3's miss, exact hit and partial hits are in its cut-point sweep below)."""
    model = "smollm2"
    adapter = q8(model)
    assert adapter.cache_refusal is None and adapter.flash_attn
    assert adapter.namespace.kv_dtype == "q8_0" and adapter.namespace.flash_attn
    prompts = _prompts(system_prompts, model)
    uncached = EdgeSync(adapter, store=False)
    reference = [uncached.generate(p, max_tokens=MAX_TOKENS) for p in prompts[1:]]
    reference.insert(0, reference[0])  # the miss and the exact hit are the same prompt
    with EdgeSync(adapter, store=tmp_path / "store") as es:
        results = [es.generate(p, max_tokens=MAX_TOKENS) for p in prompts]
        tokens = [es.prompt_tokens(p) for p in prompts]
    first = tokens[0]
    assert len(first) > 400
    assert [r.hit for r in results] == ["miss", "exact", "partial", "partial", "partial"]
    assert results[0].fragments_written >= 2
    assert results[1].tokens_reused == results[1].prompt_tokens - 1
    cuts = []
    for t, r in zip(tokens[2:], results[2:]):
        k = common_prefix_len(first, t)
        assert k >= r.tokens_reused >= k - 128 and r.tokens_prefilled == r.prompt_tokens - r.tokens_reused
        cuts.append(r.tokens_reused)
    assert len(set(cuts)) == 3  # three different injection points
    print(f"{model} q8_0: prompt tokens {[r.prompt_tokens for r in results]}, "
          f"injected {[r.tokens_reused for r in results]}")
    differ = [(i, r.hit, r.tokens_reused) for i, (r, ref) in enumerate(zip(results, reference))
              if r.tokens != ref.tokens]
    assert not differ, f"greedy tokens differ from the uncached q8_0 run at {differ}"
    assert all(len(ref.tokens) >= 4 for ref in reference)


def _fragments(store_dir, kv_dtype: str) -> tuple[dict[tuple, object], int]:
    """The ``kv_dtype`` fragments of a store by (token_start, token_end, layer_start,
    layer_end, head_start), and their blobs' bytes (compressed, as stored)."""
    store = FragmentStore(store_dir, readonly=True)
    try:
        out, blob_bytes = {}, 0
        for key, _head, _life, nbytes in store.iterate():
            f = store.get(key, copy=True)
            if f.namespace.kv_dtype == kv_dtype:
                out[(f.token_start, f.token_end, f.layer_start, f.layer_end, f.head_start)] = f
                blob_bytes += nbytes
    finally:
        store.close()
    return out, blob_bytes


@pytest.mark.parametrize("model", MODELS)
def test_q8_0_fragments_are_q8_0_rows(model, q8, system_prompts, tmp_path):
    q8_adapter = q8(model)
    f16_adapter = LlamaCppAdapter(_path(model), n_ctx=N_CTX)
    try:
        assert f16_adapter.namespace != q8_adapter.namespace
        assert (f16_adapter.namespace.kv_dtype, f16_adapter.namespace.flash_attn) == ("f16", False)
        prompt = chat(system_prompts[0], QUESTIONS[0])
        for adapter, name in ((f16_adapter, "f16"), (q8_adapter, "q8_0")):
            with EdgeSync(adapter, store=tmp_path / name) as es:
                assert es.generate(prompt, max_tokens=4).hit == "miss"
        # no cross-serving: each adapter misses on the other's store, and writes its own namespace
        for adapter, other in ((f16_adapter, "q8_0"), (q8_adapter, "f16")):
            with EdgeSync(adapter, store=tmp_path / other) as es:
                assert es.generate(prompt, max_tokens=4).hit == "miss"
    finally:
        f16_adapter.close()
    f16, f16_blobs = _fragments(tmp_path / "f16", "f16")
    q8_frags, q8_blobs = _fragments(tmp_path / "q8_0", "q8_0")
    assert set(_fragments(tmp_path / "f16", "q8_0")[0]) == set(q8_frags)  # the cross miss stored its own
    assert f16 and set(f16) == set(q8_frags)  # the same spans, layers and heads
    values, nbytes = Q8_0_BLOCK
    raw_f16 = raw_q8 = 0
    for key, f in q8_frags.items():
        ref = f16[key]
        assert f.keys.dtype == np.uint8 and ref.keys.dtype == np.float16
        n_values = ref.keys.shape[-1]
        assert f.keys.shape == f.values.shape == (*ref.keys.shape[:-1], n_values // values * nbytes)
        assert f.keys.nbytes * 2 * values == ref.keys.nbytes * nbytes  # 34 bytes / 32 values vs 2 bytes each
        assert np.array_equal(f.token_ids, ref.token_ids)
        raw_f16 += ref.keys.nbytes + ref.values.nbytes
        raw_q8 += f.keys.nbytes + f.values.nbytes
    assert raw_q8 * 2 * values == raw_f16 * nbytes
    # compressed: q8_0 rows compress less than f16 ones, but the store is still well under f16
    print(f"{model}: per cached prompt, raw f16 {raw_f16} B, q8_0 {raw_q8} B; stored f16 {f16_blobs} B, "
          f"q8_0 {q8_blobs} B ({q8_blobs / f16_blobs:.3f})")
    assert q8_blobs < 0.75 * f16_blobs


ROW_BYTES = {"q4_0": (32, 18, np.uint8), "f32": (1, 4, np.float32)}
"""Values per block, bytes per block and the row items' dtype (ggml-common.h ``block_q4_0``:
an f16 scale and 32 4-bit values)."""


@pytest.mark.parametrize(("kv", "model"), [("q4_0", "smollm2"), ("q4_0", "gemma3"), ("f32", "smollm2")])
def test_other_kv_types_match_uncached(kv, model, system_prompts, tmp_path):
    """q4_0 and f32 the same way: a miss, an exact and a partial hit, each identical to the
    uncached run of the same KV type; fragments hold rows of that type."""
    adapter = LlamaCppAdapter(_path(model), n_ctx=N_CTX, kv_type=kv)
    try:
        assert adapter.cache_refusal is None and adapter.namespace.kv_dtype == kv
        assert adapter.flash_attn == (kv == "q4_0")
        prompts = [chat(system_prompts[1], QUESTIONS[0]), chat(system_prompts[1], QUESTIONS[0]),
                   chat(system_prompts[1], QUESTIONS[1])]
        uncached = EdgeSync(adapter, store=False)
        reference = [uncached.generate(p, max_tokens=MAX_TOKENS).tokens for p in prompts[1:]]
        reference.insert(0, reference[0])  # the miss and the exact hit are the same prompt
        with EdgeSync(adapter, store=tmp_path / "store") as es:
            results = [es.generate(p, max_tokens=MAX_TOKENS) for p in prompts]
    finally:
        adapter.close()
    assert [r.hit for r in results] == ["miss", "exact", "partial"]
    assert results[2].tokens_reused >= 256
    assert [r.tokens for r in results] == reference
    fragments, _ = _fragments(tmp_path / "store", kv)
    ns = adapter.namespace
    values, nbytes, dtype = ROW_BYTES[kv]
    assert fragments
    for f in fragments.values():
        heads = (f.head_end or ns.n_head_kv) - f.head_start
        assert f.keys.dtype == dtype and f.keys.nbytes == len(range(f.layer_start, f.layer_end, f.layer_stride)) * (
            f.token_end - f.token_start) * heads * ns.head_dim // values * nbytes


SWEEP_CUTS = (100, 500, 511, 512, 513, 700, 900)
"""Target injection points of the Gemma 3 q8_0 sweep, in tokens: within the 512-token window,
at its edge and beyond it."""


def test_gemma3_q8_0_cut_point_sweep(q8, system_prompts, tmp_path):
    """Gemma 3 with q8_0 KV (flash attention on, where cached and uncached logits may differ in
    the last bits): one stored ~970-token prompt (a miss, then an exact hit), then prompts that
    share its first ~N tokens for each N of :data:`SWEEP_CUTS`, each a partial hit; every
    answer's greedy tokens equal the uncached q8_0 run's."""
    adapter = q8("gemma3")
    head, tail = "<start_of_turn>user\n", "\n\nWhat is this about?<end_of_turn>\n<start_of_turn>model\n"
    context = "\n\n".join(system_prompts[:3])
    stored = f"{head}{context}{tail}"

    def cut_text(n: int) -> str:
        """The longest whole-word prefix of the context whose prompt starts with ~n tokens."""
        words = context.split(" ")
        lo, hi = 1, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(adapter.tokenize(head + " ".join(words[:mid]))) <= n:
                lo = mid
            else:
                hi = mid - 1
        return head + " ".join(words[:lo])

    prompts = [cut_text(n) + " ... and then? Answer in one line." + tail for n in SWEEP_CUTS]
    uncached = EdgeSync(adapter, store=False)
    reference = [uncached.generate(p, max_tokens=MAX_TOKENS).tokens for p in [stored, *prompts]]
    with EdgeSync(adapter, store=tmp_path / "store") as es:
        miss, exact = es.generate(stored, max_tokens=MAX_TOKENS), es.generate(stored, max_tokens=MAX_TOKENS)
        results = [es.generate(p, max_tokens=MAX_TOKENS) for p in prompts]
    assert (miss.hit, exact.hit) == ("miss", "exact") and miss.prompt_tokens > 900 and miss.fragments_written >= 2
    assert exact.tokens_reused == exact.prompt_tokens - 1
    assert miss.tokens == exact.tokens == reference.pop(0) and len(miss.tokens) >= 4
    cuts = [r.tokens_reused for r in results]
    print(f"gemma3 q8_0 sweep: injected {cuts}")
    assert all(r.hit == "partial" for r in results)
    assert len(set(cuts)) >= len(SWEEP_CUTS) - 2 and min(cuts) < 512 < max(cuts)
    differ = [c for c, r, ref in zip(cuts, results, reference) if r.tokens != ref]
    assert not differ, f"greedy tokens differ from the uncached q8_0 run after injecting {differ} tokens"
