"""The one-copy seq-state buffer (``adapters/state_buffer.py``) against llama.cpp's own bytes and
against the reference writer (``assemble_kv`` + ``seqstate_writer.serialize_parts``).

On the real SmolLM2 (f16 with V transposed, f16 with flash attention so V is not, q8_0) and
Gemma 3 270M (two cache parts, a sliding window): the buffer built from stored fragments (cut
into layer groups with a stride and head groups, the last one cut short), or from a RAM tier's
staged copies of them, is byte for byte ``llama_state_seq_get_data`` of an uncached prefill of
the same tokens, and the live state after injecting it reads back the same bytes. Without a
model: random layouts (one to three parts, a part without layers, cell extensions with and
without 2D positions, f16, f32, bf16, q8_0, q4_0, V transposed or not) give the reference
writer's bytes.
"""

from __future__ import annotations

import copy

import llama_cpp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from seqstate_writer import serialize_parts, to_parts

from edgesync_engines.adapters import seqstate, state_buffer
from edgesync_engines.adapters.kv_blocks import assemble_kv, fragment_blocks
from edgesync_engines.adapters.kv_layout import StateLayout
from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.adapters.model_files import gemma3_model_path
from edgesync_store.lifecycle.merge import split_heads, split_layers
from edgesync_store.schema import KVFragment, Namespace, prefix_hash

N_CTX = 1024


@pytest.fixture(scope="module")
def engines(adapter):
    """SmolLM2 as the session's adapter (f16, V transposed), with flash attention, with q8_0 KV,
    and Gemma 3 270M; each loaded on first use."""
    made = {"f16": adapter}

    def get(name: str) -> LlamaCppAdapter:
        if name not in made:
            if name == "gemma3":
                made[name] = LlamaCppAdapter(gemma3_model_path(), n_ctx=N_CTX)
            else:
                made[name] = LlamaCppAdapter(n_ctx=N_CTX, flash_attn=True,
                                             kv_type="q8_0" if name == "q8_0" else "f16")
        return made[name]

    yield get
    for name, a in made.items():
        if name != "f16":
            a.close()


@pytest.fixture(scope="module")
def prompt_text(system_prompts):
    return "\n\n".join(system_prompts[:2]) + "\n\nWhat should I revise first?"


def _state_of(a: LlamaCppAdapter, tokens: list[int]) -> bytes:
    """llama.cpp's seq state after evaluating ``tokens`` in one batch from an empty cache (the
    cells of a shorter batch from position 0 are those of a longer one: test_llamacpp)."""
    a.clear_kv_cache()
    a.llm.eval(tokens)
    return a._get_state()


@pytest.mark.model
@pytest.mark.parametrize("engine", ["f16", "flash-f16", "q8_0", "gemma3"])
def test_buffer_from_fragments_is_llama_cpps_own_state(engines, prompt_text, engine):
    a = engines(engine)
    ns, layout = a.namespace, a._layout
    tokens = a.tokenize(prompt_text)
    n = 300  # under Gemma's 512-token window: every part holds every cell
    assert len(tokens) > 330
    _state_of(a, tokens[:330])
    whole = a.extract_fragments(tokens, [(0, 128), (128, 256), (256, 330)])
    # head groups, layer groups with a stride, layer groups, the last cut short at n
    strided = [KVFragment(namespace=ns, token_start=128, token_end=256, layer_start=s, layer_end=ns.n_layer,
                          layer_stride=2, keys=whole[1].keys[s::2], values=whole[1].values[s::2],
                          token_ids=whole[1].token_ids, prefix_hash=whole[1].prefix_hash) for s in (0, 1)]
    fragments = [*(split_heads(whole[0], 1) if ns.n_head_kv > 1 else [whole[0]]), *strided,
                 *split_layers(whole[2], 7)]
    blocks = fragment_blocks(ns, fragments, n, tokens)
    buf, views = state_buffer.build(layout, ns.head_width, blocks, n, tokens)
    assert len(views) == len(layout.part_layers)

    k, v = assemble_kv(ns, fragments, n, tokens)
    assert bytes(buf) == bytes(serialize_parts(to_parts(layout, k, v, tokens)))
    for i, (kp, vp) in enumerate(views):
        rows = layout.part_range(i)
        assert np.array_equal(np.ascontiguousarray(kp).view(np.uint8), k[rows.start:rows.stop].view(np.uint8))
        assert np.array_equal(np.ascontiguousarray(vp).view(np.uint8), v[rows.start:rows.stop].view(np.uint8))

    # a RAM tier's staged copies (V laid out as the state holds it) give the same bytes
    staged = [a.stage_fragment(copy.copy(f)) for f in fragments]
    for s, f in zip(staged, fragments):
        assert np.array_equal(s.values, f.values)
        assert s.values.flags.c_contiguous == (layout.v_trans == 0)
    assert bytes(state_buffer.build(layout, ns.head_width, fragment_blocks(ns, staged, n, tokens), n, tokens)[0]) \
        == bytes(buf)

    uncached = _state_of(a, tokens[:n])
    assert bytes(buf) == uncached
    a.clear_kv_cache()
    assert a.inject_fragment(fragments, n, tokens) == n
    assert a._get_state() == uncached
    a.clear_kv_cache()


@pytest.mark.model
def test_a_block_that_does_not_fit_the_layout_is_refused(adapter):
    ns, layout = adapter.namespace, adapter._layout
    tokens = list(range(100, 300))
    k = np.zeros((ns.n_layer, 128, ns.n_head_kv * ns.head_width), ns.np_dtype)
    frag = KVFragment(namespace=ns, token_start=0, token_end=128, layer_start=0, layer_end=ns.n_layer,
                      keys=k, values=k, token_ids=tokens[:128], prefix_hash=prefix_hash([]))
    block = fragment_blocks(ns, [frag], 128, tokens)[0]
    narrow = type(block)(block.layers, range(0, 1), 0, 128, block.keys, block.values)
    with pytest.raises(seqstate.SeqStateError, match="rows of"):
        state_buffer.build(layout, ns.head_width, [narrow], 128, tokens)
    with pytest.raises(seqstate.SeqStateError, match="need at least one cell"):
        state_buffer.build(layout, ns.head_width, [block], 0, tokens)
    with pytest.raises(seqstate.SeqStateError, match=r"\[128, 128\)"):
        state_buffer.build(layout, ns.head_width, [block], 128, tokens, start=128)


TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2}


@st.composite
def layouts(draw):
    kv = draw(st.sampled_from(sorted(TYPES)))
    quantized = kv in ("q8_0", "q4_0")
    n_parts = draw(st.integers(1, 3))
    part_layers = tuple(draw(st.integers(0 if i else 1, 3)) for i in range(n_parts))
    n_head_kv = draw(st.integers(1, 3))
    head_dim = 32 * draw(st.integers(1, 2)) if quantized else draw(st.sampled_from([2, 4, 8]))
    ns = Namespace(model_fingerprint="cd" * 32, engine="llama.cpp", engine_version="test", kv_dtype=kv,
                   flash_attn=quantized, layout="test", n_layer=sum(part_layers), n_head_kv=n_head_kv,
                   head_dim=head_dim, kernels="test")
    cell_ext = draw(st.booleans())
    layout = StateLayout(part_layers, 1 if n_parts > 1 else None, 16, cell_ext, cell_ext and draw(st.booleans()),
                         TYPES[kv], 0 if quantized else draw(st.integers(0, 1)), n_head_kv * ns.head_width,
                         draw(st.integers(1, 4)))  # a stream per sequence (slots) or one
    return ns, layout


@settings(max_examples=60, deadline=None)
@given(spec=layouts(), data=st.data())
def test_random_layouts_match_the_reference_writer(spec, data):
    ns, layout = spec
    n_total = data.draw(st.integers(64, 200))
    cuts = sorted(set(data.draw(st.lists(st.integers(64, n_total - 64), max_size=2)))) if n_total >= 128 else []
    bounds = [0]
    for c in cuts:
        if c - bounds[-1] >= 64:
            bounds.append(c)
    if n_total - bounds[-1] < 64:
        bounds.pop()
    bounds.append(n_total)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    tokens = rng.integers(0, 50000, n_total).tolist()
    width = ns.n_head_kv * ns.head_width
    fragments = []
    for lo, hi in zip(bounds, bounds[1:]):
        stride = data.draw(st.integers(1, 2)) if ns.n_layer > 1 else 1
        for start in range(stride):
            layers = range(start, ns.n_layer, stride)
            shape = (len(layers), hi - lo, width)
            k = rng.integers(0, 256, shape[0] * shape[1] * shape[2] * ns.np_dtype.itemsize, dtype=np.uint8)
            v = rng.integers(0, 256, k.size, dtype=np.uint8)
            fragments.append(KVFragment(namespace=ns, token_start=lo, token_end=hi, layer_start=start,
                                        layer_end=ns.n_layer, layer_stride=stride,
                                        keys=k.view(ns.np_dtype).reshape(shape),
                                        values=v.view(ns.np_dtype).reshape(shape),
                                        token_ids=tokens[lo:hi], prefix_hash=prefix_hash(tokens[:lo])))
    n = data.draw(st.integers(bounds[-2] + 1 if len(bounds) > 2 else 1, n_total))
    buf, _ = state_buffer.build(layout, ns.head_width, fragment_blocks(ns, fragments, n, tokens), n, tokens, 3)
    k, v = assemble_kv(ns, fragments, n, tokens)
    assert bytes(buf) == bytes(serialize_parts(to_parts(layout, k, v, tokens), 3))
    assert len(buf) == state_buffer.state_bytes(layout, n)


@pytest.mark.model
def test_llama_cpp_reads_the_buffer_it_wrote(adapter, prompt_text):
    """The buffer's length is what llama.cpp asks for a state of that many cells."""
    tokens = adapter.tokenize(prompt_text)[:200]
    adapter.prefill(tokens)
    size = llama_cpp.llama_state_seq_get_size(adapter._ctx, 0)
    assert size == state_buffer.state_bytes(adapter._layout, 200)
    adapter.clear_kv_cache()
