"""Placing stored KV at another position of a llama.cpp sequence (``adapters/llamacpp_blend.py``
through ``LlamaCppAdapter.place_kv`` / ``recompute``), on the real SmolLM2 model.

Data: passage rows 0 and 1 of ``doc_qa.jsonl`` (their ``context``), and app system prompts of
``system_prompts.json`` as the text before them, so the passage lands at three offsets.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgesync_engines.adapters import seqstate
from edgesync_engines.adapters.protocol import InjectionError
from edgesync_store.schema import chunk_spans

pytestmark = [pytest.mark.model]

F16_TOL = 2.0 ** -7 * 1.01
"""One f16 step at |K| in [8, 16) (SmolLM2's layer-0 K reaches ~10): the rounding of K stored
as f16 before and after the RoPE shift."""


@pytest.fixture(scope="module")
def passages(data_dir) -> list[str]:
    with open(data_dir / "doc_qa.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["context"] for line, _ in zip(f, range(2))]


def live_k(adapter, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions and K rows of ``layer`` of the live sequence, sorted by position (a blend
    leaves cells out of position order in the cache)."""
    part = seqstate.parse_parts(adapter._get_state(), 0)[0]
    order = np.argsort(part.pos)
    return part.pos[order], np.asarray(part.k[layer])[order].astype(np.float32)


def stored_chain(adapter, tokens: list[int]):
    """Fragments of ``tokens`` computed standalone from position 0 (a document's chain)."""
    adapter.prefill(tokens)
    frags = adapter.extract_fragments(tokens, chunk_spans(len(tokens)))
    adapter.clear_kv_cache()
    return frags


@pytest.mark.parametrize("n_prompts", [0, 1, 3])
def test_a_placed_document_has_the_full_prefills_layer0_k_at_three_offsets(adapter, passages, system_prompts,
                                                                          n_prompts):
    doc = adapter.tokenize(passages[0], add_bos=False, special=False)
    head_text = "".join(system_prompts[:n_prompts]) + "Read this:\n"
    head = adapter.tokenize(head_text)
    question = adapter.tokenize("\n\nWhat is it about?", add_bos=False)
    tokens = head + doc + question
    frags = stored_chain(adapter, doc)
    adapter.prefill(tokens)
    pos_full, k_full = live_k(adapter, 0)
    _, k15_full = live_k(adapter, 15)

    adapter.clear_kv_cache()
    adapter.prefill(head)
    adapter.place_kv(frags, doc, (0, len(doc)), len(head), tokens)
    end = len(head) + len(doc)
    assert adapter.n_tokens == end
    adapter.prefill(tokens[:end + 1], end)  # the next decode applies llama.cpp's K-shift
    pos, k = live_k(adapter, 0)
    assert list(pos) == list(range(end + 1)) == list(pos_full[:end + 1])
    at = slice(len(head), end)
    assert np.abs(k[at] - k_full[at]).max() <= F16_TOL * max(1.0, np.abs(k_full[at]).max() / 8)
    # the deeper layers attended to another context: the recompute's job, so they differ
    _, k15 = live_k(adapter, 15)
    assert np.abs(k15[at] - k15_full[at]).max() > 0.5
    adapter.clear_kv_cache()


def test_recomputed_first_tokens_equal_a_full_prefill_at_every_layer(adapter, passages):
    doc = adapter.tokenize(passages[1], add_bos=False, special=False)
    head = adapter.tokenize("<|im_start|>system\nAnswer from the document.<|im_end|>\n<|im_start|>user\n")
    tokens = head + doc + adapter.tokenize("\n\nWho?", add_bos=False)
    frags = stored_chain(adapter, doc)
    adapter.prefill(tokens)
    full = [live_k(adapter, layer)[1] for layer in (0, 15, 29)]
    adapter.clear_kv_cache()
    adapter.prefill(head)
    adapter.place_kv(frags, doc, (0, len(doc)), len(head), tokens)
    a, b = len(head), len(head) + 8
    adapter.recompute(tokens, a, b)
    after = [live_k(adapter, layer)[1] for layer in (0, 15, 29)]
    for k_full, k in zip(full, after):
        # against the exact head alone, as in the full prefill: equal up to kernel rounding
        assert np.abs(k[a:b] - k_full[a:b]).max() < 0.1
    # tokens after the run were not recomputed: still the standalone KV at deep layers
    assert np.abs(after[1][b:b + 50] - full[1][b:b + 50]).max() > 0.5
    adapter.clear_kv_cache()


def test_place_kv_refuses_tokens_that_differ_and_leaves_the_sequence(adapter, passages):
    doc = adapter.tokenize(passages[0], add_bos=False, special=False)
    frags = stored_chain(adapter, doc)
    head = adapter.tokenize("Context:\n")
    tokens = head + doc
    wrong = head + [doc[0] + 1] + doc[1:]
    adapter.prefill(head)
    with pytest.raises(ValueError, match="differ"):
        adapter.place_kv(frags, doc, (0, len(doc)), len(head), wrong)
    assert adapter.n_tokens == len(head)
    adapter.place_kv(frags, doc, (0, len(doc)), len(head), tokens)
    assert adapter.n_tokens == len(tokens)
    adapter.clear_kv_cache()


def test_smollm2_can_blend_and_gemma_cannot(adapter):
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
    from edgesync_engines.adapters.model_files import gemma3_model_path

    assert adapter.blend_refusal is None
    gemma = LlamaCppAdapter(gemma3_model_path(), n_ctx=1024)
    try:
        assert gemma.cache_refusal is None
        assert "sliding-window" in gemma.blend_refusal
        with pytest.raises(InjectionError, match="sliding-window"):
            gemma.recompute([1, 2, 3], 0, 3)
    finally:
        gemma.close()
