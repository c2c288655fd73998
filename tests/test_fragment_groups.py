"""Chunks stored as layer groups and KV-head groups: split, merge, inject and the router's
grouped writes, on the real SmolLM2-135M model (30 layers, 3 KV heads of 64, f16).

The prompt: StudyBuddy's system prompt (system_prompts.json row 0) and one user question.
Injected KV is judged by the next-token logits after the last prompt token is evaluated:
bitwise equal (np.array_equal) to the logits of the chunks extracted whole, and to an uncached
prefill's.
"""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from fragments import SMOL

from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request import storeback
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore
from edgesync_store.lifecycle.merge import (
    group_ranges,
    head_groups,
    layer_groups,
    merge_heads,
    merge_layers,
    split_heads,
    split_layers,
)
from edgesync_store.schema import KVFragment, chunk_spans, prefix_hash

QUESTION = "How do I revise for a chemistry test?"


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@pytest.fixture(scope="module")
def prompt(adapter, system_prompts):
    return adapter.tokenize(adapter.apply_chat_template(chat(system_prompts[0], QUESTION)))


def last_logits(adapter) -> np.ndarray:
    n_vocab = llama_cpp.llama_vocab_n_tokens(adapter._vocab)
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(adapter._ctx, -1), shape=(n_vocab,)).copy()


def prefill(adapter, tokens) -> np.ndarray:
    """Uncached: clear, evaluate the router's batches (last token alone), return the logits."""
    adapter.clear_kv_cache()
    for start, end in adapter.prefill_plan(0, len(tokens)):
        adapter.llm.eval(tokens[start:end])
    return last_logits(adapter)


def injected_logits(adapter, fragments, tokens) -> np.ndarray:
    """Inject all but the last prompt token from ``fragments``, evaluate the last, return logits."""
    n = len(tokens)
    adapter.clear_kv_cache()
    assert adapter.inject_fragment(fragments, n - 1, tokens) == n - 1
    for start, end in adapter.prefill_plan(n - 1, n):
        adapter.llm.eval(tokens[start:end])
    return last_logits(adapter)


@pytest.fixture(scope="module")
def live(adapter, prompt):
    """The prompt prefilled uncached: (reference logits, chunk spans, chunks extracted whole).
    The live sequence stays the prompt's, so later extractions read the same KV."""
    reference = prefill(adapter, prompt)
    spans = chunk_spans(len(prompt) - 1, 128)
    return reference, spans, adapter.extract_fragments(prompt, spans)


def extract(adapter, prompt, spans, *ranges: dict) -> list[list[KVFragment]]:
    """The fragments of each of ``ranges`` (extract_fragments arguments), all extracted from
    one fresh uncached prefill (earlier tests may have injected other KV; extracting leaves
    the live sequence as it is)."""
    prefill(adapter, prompt)
    return [adapter.extract_fragments(prompt, spans, **r) for r in ranges]


@pytest.mark.model
def test_whole_chunks_give_the_uncached_logits(adapter, prompt, live):
    reference, spans, whole = live
    assert len(spans) >= 2 and spans[-1][1] == len(prompt) - 1
    assert np.array_equal(injected_logits(adapter, whole, prompt), reference)


@pytest.mark.model
def test_layer_halves_merged_on_axis_0_equal_the_whole_chunk(adapter, prompt, live):
    reference, spans, whole = live
    low, high = extract(adapter, prompt, spans, {"layer_start": 0, "layer_end": 15},
                        {"layer_start": 15, "layer_end": 30})
    assert [f.n_layers for f in low + high] == [15] * (2 * len(spans))
    # the halves, un-merged, together
    assert np.array_equal(injected_logits(adapter, low + high, prompt), reference)
    merged = [merge_layers([h, lo]) for lo, h in zip(low, high)]  # order of parts does not matter
    for m, w in zip(merged, whole):
        assert m.key() == w.key()
        assert (m.layer_start, m.layer_end, m.layer_stride, m.head_start, m.head_end) == (0, 30, 1, 0, 3)
        assert m.keys.dtype == np.float16 and m.keys.shape == w.keys.shape == (30, w.span, 192)
        assert np.array_equal(m.keys, w.keys) and np.array_equal(m.values, w.values)
    assert np.array_equal(injected_logits(adapter, merged, prompt), reference)
    # cutting a whole chunk gives the halves extracted from the engine
    cut = split_layers(whole[0], 15)
    assert [(f.layer_start, f.layer_end) for f in cut] == [(0, 15), (15, 30)]
    assert [f.key() for f in cut] == [low[0].key(), high[0].key()]
    assert all(np.array_equal(c.keys, e.keys) and np.array_equal(c.values, e.values)
               for c, e in zip(cut, (low[0], high[0])))


@pytest.mark.model
def test_stride_sampled_layers_merge_to_the_whole_chunk(adapter, prompt, live):
    reference, spans, whole = live
    even, odd = extract(adapter, prompt, spans, {"layer_start": 0, "layer_end": 30, "layer_stride": 2},
                        {"layer_start": 1, "layer_end": 30, "layer_stride": 2})
    assert list(even[0].layers) == list(range(0, 30, 2)) and list(odd[0].layers) == list(range(1, 30, 2))
    assert np.array_equal(injected_logits(adapter, even + odd, prompt), reference)
    merged = [merge_layers([e, o]) for e, o in zip(even, odd)]
    for m, w in zip(merged, whole):
        assert m.key() == w.key()
        assert np.array_equal(m.keys, w.keys) and np.array_equal(m.values, w.values)
    assert np.array_equal(injected_logits(adapter, merged, prompt), reference)


@pytest.mark.model
def test_head_groups_merged_on_axis_1_equal_the_whole_chunk(adapter, prompt, live):
    reference, spans, whole = live
    assert adapter.namespace.n_head_kv == 3
    first, last = extract(adapter, prompt, spans, {"head_start": 0, "head_end": 2}, {"head_start": 2, "head_end": 3})
    assert first[0].keys.shape == (30, first[0].span, 128) and last[0].keys.shape == (30, last[0].span, 64)
    assert np.array_equal(injected_logits(adapter, first + last, prompt), reference)
    merged = [merge_heads([b, a]) for a, b in zip(first, last)]
    for m, w in zip(merged, whole):
        assert m.key() == w.key()
        assert np.array_equal(m.keys, w.keys) and np.array_equal(m.values, w.values)
    assert np.array_equal(injected_logits(adapter, merged, prompt), reference)
    # [0, 1) + [1, 3) cut from the whole chunk, and one head per fragment
    cut = split_heads(whole[0], 2)
    assert [(f.head_start, f.head_end) for f in cut] == [(0, 2), (2, 3)]
    assert [f.key() for f in cut] == [first[0].key(), last[0].key()]
    ones = split_heads(whole[0], 1)
    assert [(f.head_start, f.head_end) for f in ones] == [(0, 1), (1, 2), (2, 3)]
    assert np.array_equal(merge_heads(ones).keys, whole[0].keys)


@pytest.mark.model
def test_layer_x_head_groups_merge_back_and_store_under_the_whole_key(adapter, prompt, live, tmp_path):
    reference, spans, whole = live
    parts = [p for lp in split_layers(whole[0], 15) for p in split_heads(lp, 1)]
    assert len(parts) == 6
    by_layers = [merge_heads(parts[i : i + 3]) for i in (0, 3)]
    merged = merge_layers(by_layers)
    assert merged.key() == whole[0].key()
    assert np.array_equal(merged.keys, whole[0].keys) and np.array_equal(merged.values, whole[0].values)
    with FragmentStore(tmp_path / "store") as store:
        assert store.put(merged) is True
        assert store.put(whole[0]) is False  # the same key: a duplicate
        got = store.get(whole[0].key())
        assert np.array_equal(got.keys, whole[0].keys) and np.array_equal(got.values, whole[0].values)
    assert np.array_equal(injected_logits(adapter, parts + whole[1:], prompt), reference)


# -- pure checks on synthetic fragments (SmolLM2's geometry, no model) ---------------------------

def synthetic(token_start=0, span=64, layers=(0, 30, 1), heads=(0, 3), tokens=None, ns=SMOL, **life) -> KVFragment:
    n_layers = len(range(*layers))
    width = (heads[1] - heads[0]) * ns.head_dim
    rng = np.random.default_rng(token_start + 7 * layers[0] + heads[0])
    ids = np.arange(token_start, token_start + span) if tokens is None else np.asarray(tokens)
    return KVFragment(
        namespace=ns, token_start=token_start, token_end=token_start + span,
        layer_start=layers[0], layer_end=layers[1], layer_stride=layers[2], head_start=heads[0], head_end=heads[1],
        keys=rng.standard_normal((n_layers, span, width)).astype(np.float16),
        values=rng.standard_normal((n_layers, span, width)).astype(np.float16),
        token_ids=ids, prefix_hash=prefix_hash(range(token_start)), **life,
    )


def test_groups_and_their_bad_arguments():
    assert layer_groups(30, 15) == [(0, 15), (15, 30)]
    assert layer_groups(30, 16) == [(0, 16), (16, 30)]
    assert layer_groups(30, 30) == [(0, 30)]
    assert head_groups(3, 2) == [(0, 2), (2, 3)]
    assert head_groups(3, 1) == [(0, 1), (1, 2), (2, 3)]
    for bad in (0, 31, -1, True, 1.5):
        with pytest.raises(ValueError, match="^layers_per_fragment"):
            layer_groups(30, bad)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="^heads_per_fragment"):
            head_groups(3, bad)
    with pytest.raises(ValueError, match="^layers_per_fragment"):
        split_layers(synthetic(), 31)
    with pytest.raises(ValueError, match="^heads_per_fragment"):
        split_heads(synthetic(heads=(1, 3)), 3)
    assert group_ranges(SMOL, None, None) == [((0, 30), (0, 3))]
    assert group_ranges(SMOL, 15, 2) == [((0, 15), (0, 2)), ((0, 15), (2, 3)), ((15, 30), (0, 2)), ((15, 30), (2, 3))]
    assert group_ranges(SMOL, 100, 9) == [((0, 30), (0, 3))]  # clamped to the model
    with pytest.raises(ValueError, match="^heads_per_fragment"):
        group_ranges(SMOL, None, 0)


def test_split_of_a_strided_fragment_keeps_its_layers():
    odd = synthetic(layers=(1, 30, 2))
    parts = split_layers(odd, 4)
    assert [list(p.layers) for p in parts] == [[1, 3, 5, 7], [9, 11, 13, 15], [17, 19, 21, 23], [25, 27, 29]]
    assert all(p.layer_end <= 30 for p in parts)
    assert np.array_equal(np.concatenate([p.keys for p in parts]), odd.keys)


def test_merge_keeps_the_lifecycle_without_summing_hits():
    emb = np.full(384, 0.5, dtype=np.float32)
    a = synthetic(layers=(0, 15, 1), created_at=100.0, expires_at=1900.0, hit_count=4, last_hit_at=500.0)
    b = synthetic(layers=(15, 30, 1), created_at=90.0, expires_at=2000.0, hit_count=3, last_hit_at=600.0,
                  embedding=emb)
    m = merge_layers([a, b])
    assert (m.created_at, m.expires_at, m.hit_count, m.last_hit_at) == (90.0, 2000.0, 4, 600.0)
    assert np.array_equal(m.embedding, emb)
    assert m.content_hash == a.content_hash and m.prefix_hash == a.prefix_hash
    assert np.array_equal(m.keys[:15], a.keys) and np.array_equal(m.values[15:], b.values)


def test_merge_layers_names_what_disagrees():
    low, high = synthetic(layers=(0, 15, 1)), synthetic(layers=(15, 30, 1))
    with pytest.raises(ValueError, match="^layers: overlapping layer 14"):
        merge_layers([low, synthetic(layers=(14, 30, 1))])
    with pytest.raises(ValueError, match="^layers: missing layer 15"):
        merge_layers([low, synthetic(layers=(16, 30, 1))])
    with pytest.raises(ValueError, match="^layers: missing layer 29"):
        merge_layers([synthetic(layers=(0, 30, 2)), synthetic(layers=(1, 29, 2))])
    with pytest.raises(ValueError, match="^layers: overlapping layer 0"):
        merge_layers([synthetic(layers=(0, 30, 2)), synthetic(layers=(0, 30, 3))])
    with pytest.raises(ValueError, match="^span"):
        merge_layers([low, synthetic(layers=(15, 30, 1), span=65)])
    with pytest.raises(ValueError, match="^token_ids"):
        merge_layers([low, synthetic(layers=(15, 30, 1), tokens=np.arange(64) + 1)])
    other_ns = SMOL.__class__(**{**SMOL.to_dict(), "layout": "other"})
    with pytest.raises(ValueError, match="^namespace"):
        merge_layers([low, synthetic(layers=(15, 30, 1), ns=other_ns)])
    shifted = synthetic(layers=(15, 30, 1))
    shifted.prefix_hash = prefix_hash([9])
    with pytest.raises(ValueError, match="^prefix_hash"):
        merge_layers([low, shifted])
    with pytest.raises(ValueError, match="^heads"):
        merge_layers([low, synthetic(layers=(15, 30, 1), heads=(0, 2))])
    with pytest.raises(ValueError, match="^fragments"):
        merge_layers([])
    assert merge_layers([high, low]).key() == synthetic().key()


def test_merge_heads_names_what_disagrees():
    a, b = synthetic(heads=(0, 1)), synthetic(heads=(1, 3))
    assert merge_heads([b, a]).key() == synthetic().key()
    with pytest.raises(ValueError, match="^heads: missing head 1"):
        merge_heads([a, synthetic(heads=(2, 3))])
    with pytest.raises(ValueError, match="^heads: missing head 0"):
        merge_heads([b])
    with pytest.raises(ValueError, match="^heads: missing head 2"):
        merge_heads([synthetic(heads=(0, 2))])
    with pytest.raises(ValueError, match="^heads: overlapping head 1"):
        merge_heads([synthetic(heads=(0, 2)), b])
    with pytest.raises(ValueError, match="^layers"):
        merge_heads([a, synthetic(heads=(1, 3), layers=(0, 15, 1))])
    with pytest.raises(ValueError, match="^span"):
        merge_heads([a, synthetic(heads=(1, 3), token_start=64)])
    with pytest.raises(ValueError, match="^token_ids"):
        merge_heads([a, synthetic(heads=(1, 3), tokens=np.arange(64)[::-1])])


def channel_major(frag: KVFragment) -> KVFragment:
    """``frag`` with V laid out channel-major: a transposed view of a C-contiguous
    ``[layers, width, span]`` array (as an engine stages it), the same values."""
    v = np.ascontiguousarray(frag.values.transpose(0, 2, 1)).transpose(0, 2, 1)
    return KVFragment(
        namespace=frag.namespace, token_start=frag.token_start, token_end=frag.token_end,
        layer_start=frag.layer_start, layer_end=frag.layer_end, layer_stride=frag.layer_stride,
        head_start=frag.head_start, head_end=frag.head_end, keys=frag.keys, values=v, token_ids=frag.token_ids,
        prefix_hash=frag.prefix_hash, created_at=frag.created_at, expires_at=frag.expires_at,
    )


def is_channel_major(v: np.ndarray) -> bool:
    return not v.flags.c_contiguous and v.transpose(0, 2, 1).flags.c_contiguous


@pytest.mark.parametrize("channel", [True, False], ids=["channel-major", "c-contiguous"])
def test_split_and_merge_keep_the_layout_of_v(channel):
    """V comes out of split_layers, split_heads, merge_layers and merge_heads laid out as it went
    in (channel-major stays channel-major, C-contiguous stays C-contiguous), with equal values;
    K is C-contiguous either way."""
    layout = channel_major if channel else (lambda f: f)
    whole = synthetic(span=96)
    src = layout(whole)
    assert is_channel_major(src.values) is channel and src.values.flags.c_contiguous is not channel

    def check(out: KVFragment, want_values: np.ndarray) -> None:
        assert is_channel_major(out.values) is channel
        assert out.values.flags.c_contiguous is not channel
        assert out.keys.flags.c_contiguous
        assert out.values.shape == want_values.shape
        assert np.array_equal(out.values.view(np.uint16), want_values.view(np.uint16))

    lay = split_layers(src, 4)
    assert len(lay) == 8
    for part, (a, b) in zip(lay, layer_groups(30, 4)):
        check(part, whole.values[a:b])
        assert np.array_equal(part.keys, whole.keys[a:b])
    hds = split_heads(src, 2)
    assert [(p.head_start, p.head_end) for p in hds] == [(0, 2), (2, 3)]
    check(hds[0], whole.values[:, :, :128])
    check(hds[1], whole.values[:, :, 128:])
    strided = split_layers(layout(synthetic(span=96, layers=(1, 30, 2))), 5)
    assert all(is_channel_major(p.values) is channel for p in strided)

    merged = merge_layers(lay[::-1])
    check(merged, whole.values)
    assert merged.key() == whole.key() and np.array_equal(merged.keys, whole.keys)
    merged = merge_heads([hds[1], hds[0]])
    check(merged, whole.values)
    assert merged.key() == whole.key() and np.array_equal(merged.keys, whole.keys)
    # parts made channel-major on their own (as an engine extracts them) merge the same way
    parts = [layout(synthetic(span=96, layers=(0, 30, 2))), layout(synthetic(span=96, layers=(1, 30, 2)))]
    merged = merge_layers(parts)
    want = np.empty_like(whole.values)
    want[0::2], want[1::2] = parts[0].values, parts[1].values
    check(merged, want)
    nested = merge_layers([merge_heads(split_heads(p, 1)) for p in split_layers(src, 15)])
    check(nested, whole.values)


# -- the router's grouped writes ---------------------------------------------------------------

def config(**settings) -> EdgeSyncConfig:
    return EdgeSyncConfig.load({"semantic": False, **settings})


ESSAY = "Write a long, detailed essay about how to study well for exams."


@pytest.fixture(scope="module")
def essay_reference(adapter, system_prompts):
    """The uncached answer to the essay request, computed once for both groupings."""
    return EdgeSync(adapter, store=False, config=config()).generate(chat(system_prompts[1], ESSAY), max_tokens=16)


@pytest.mark.model
@pytest.mark.parametrize(
    "settings, groups",
    [
        ({"layers_per_fragment": 15}, [((0, 15), (0, 3)), ((15, 30), (0, 3))]),
        ({"heads_per_fragment": 1}, [((0, 30), (0, 1)), ((0, 30), (1, 2)), ((0, 30), (2, 3))]),
    ],
)
def test_router_stores_groups_and_hits_them_exactly(adapter, system_prompts, essay_reference, tmp_path, settings,
                                                    groups):
    messages, reference = chat(system_prompts[1], ESSAY), essay_reference
    with FragmentStore(tmp_path / "store") as store:
        es = EdgeSync(adapter, store=store, config=config(**settings))
        tokens = es.prompt_tokens(messages)
        spans = chunk_spans(len(tokens) - 1, 128)
        expected = sorted((s, l0, l1, h0, h1) for s, _ in spans for (l0, l1), (h0, h1) in groups)

        first = es.generate(messages, max_tokens=16)
        assert first.hit == "miss" and first.fragments_written == len(spans) * len(groups) == len(expected)
        stored = sorted((h.token_start, h.layer_start, h.layer_end, h.head_start, h.head_end)
                        for _, h, _, _ in store.iterate())
        assert stored == expected

        second = es.generate(messages, max_tokens=16)
        assert second.hit == "exact" and second.tokens_reused == len(tokens) - 1
        assert second.tokens == first.tokens == reference.tokens and len(reference.tokens) == 16
        assert second.fragments_written == 0
        assert store.stats().fragments == len(expected)

        (l0, l1), (h0, h1) = groups[0]
        key = storeback.donor_key(es.namespace, tokens, es.config)
        s, e = spans[-1]
        head = store.get(key)
        assert head is not None and store.is_live(key)
        assert (head.token_start, head.token_end, head.layer_start, head.layer_end, head.head_start, head.head_end) \
            == (s, e, l0, l1, h0, h1)


@pytest.mark.model
def test_a_chunk_stored_in_another_grouping_is_not_written_again(adapter, system_prompts, tmp_path):
    """The "already stored?" check asks for coverage of the span, not for one key."""
    messages = chat(system_prompts[2], "What should I do first today?")
    with FragmentStore(tmp_path / "store") as store:
        whole = EdgeSync(adapter, store=store, config=config()).generate(messages, max_tokens=4)
        n_chunks = whole.fragments_written
        assert n_chunks >= 2 and store.stats().fragments == n_chunks
        grouped = EdgeSync(adapter, store=store, config=config(layers_per_fragment=10, heads_per_fragment=2))
        again = grouped.generate(messages, max_tokens=4)
        assert again.hit == "exact" and again.fragments_written == 0
        assert again.tokens == whole.tokens
        assert store.stats().fragments == n_chunks
    with FragmentStore(tmp_path / "store2") as store:
        grouped = EdgeSync(adapter, store=store, config=config(layers_per_fragment=10, heads_per_fragment=2))
        first = grouped.generate(messages, max_tokens=4)
        assert first.fragments_written == n_chunks * 3 * 2
        again = EdgeSync(adapter, store=store, config=config()).generate(messages, max_tokens=4)
        assert again.hit == "exact" and again.fragments_written == 0 and again.tokens == first.tokens


def test_grouping_settings_parse_and_validate():
    assert (config().layers_per_fragment, config().heads_per_fragment) == (None, None)
    env = EdgeSyncConfig.load(environ={"EDGESYNC_LAYERS_PER_FRAGMENT": "15", "EDGESYNC_HEADS_PER_FRAGMENT": "1"})
    assert (env.layers_per_fragment, env.heads_per_fragment) == (15, 1)
    assert EdgeSyncConfig.load(environ={"EDGESYNC_LAYERS_PER_FRAGMENT": ""}).layers_per_fragment is None
    with pytest.raises(ValueError, match="^layers_per_fragment.*EDGESYNC_LAYERS_PER_FRAGMENT='0'"):
        EdgeSyncConfig.load(environ={"EDGESYNC_LAYERS_PER_FRAGMENT": "0"})
    with pytest.raises(ValueError, match="EDGESYNC_HEADS_PER_FRAGMENT='two'"):
        EdgeSyncConfig.load(environ={"EDGESYNC_HEADS_PER_FRAGMENT": "two"})
    with pytest.raises(ValueError, match="^heads_per_fragment"):
        EdgeSyncConfig(heads_per_fragment=True)
