"""The llama.cpp adapter and its seq-state codec on the real SmolLM2 model.

The prompt: StudyBuddy's system prompt (system_prompts.json row 0) and one user question.
"""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from seqstate_writer import serialize_parts

from edgesync_engines.adapters import llamacpp, seqstate, state_buffer
from edgesync_engines.adapters.kv_layout import (
    ANY_ROW,
    GROUPED_ROWS,
    prefill_blocks,
    tiled_rule,
    turn_batches,
    usable_prefix,
)
from edgesync_engines.adapters.protocol import ContextOverflowError

pytestmark = [pytest.mark.model]


@pytest.fixture
def prompt(adapter, system_prompts):
    return adapter.tokenize(
        adapter.apply_chat_template(
            [
                {"role": "system", "content": system_prompts[0]},
                {"role": "user", "content": "How do I revise for a chemistry test?"},
            ]
        )
    )


def last_logits(adapter) -> np.ndarray:
    n_vocab = llama_cpp.llama_vocab_n_tokens(adapter._vocab)
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(adapter._ctx, -1), shape=(n_vocab,)).copy()


def prefill(adapter, tokens, batches) -> np.ndarray:
    """Clear, evaluate ``tokens`` in the given [start, end) batches, return the last logits."""
    adapter.clear_kv_cache()
    for start, end in batches:
        adapter.llm.eval(tokens[start:end])
    return last_logits(adapter)


def test_seq_state_round_trips_byte_for_byte(adapter, prompt):
    prefill(adapter, prompt, [(0, len(prompt))])
    raw = adapter._get_state()
    parts = seqstate.parse_parts(raw)
    ns = adapter.namespace
    assert len(parts) == 1 and parts[0].v_trans == 1 and parts[0].type_k == parts[0].type_v == 1
    np.testing.assert_array_equal(parts[0].pos, np.arange(len(prompt)))
    k = np.stack(parts[0].k)
    assert k.shape == (ns.n_layer, len(prompt), ns.n_head_kv * ns.head_dim) == (30, len(prompt), 192)
    assert k.dtype == np.dtype("<f2")
    assert bytes(serialize_parts(parts)) == raw


def test_parse_refuses_what_it_does_not_understand(adapter, prompt):
    prefill(adapter, prompt[:70], [(0, 70)])
    raw = bytearray(adapter._get_state())
    with pytest.raises(seqstate.SeqStateError, match="magic"):
        seqstate.parse_parts(b"\0" * 4 + raw[4:])
    with pytest.raises(seqstate.SeqStateError, match="truncated"):
        seqstate.parse_parts(raw[:-7])
    with pytest.raises(seqstate.SeqStateError, match="trailing"):
        seqstate.parse_parts(raw + b"\0" * 8)


def test_slice_of_a_long_prefill_equals_a_short_prefill(adapter, prompt):
    """../shared/DESIGN.md 2.2: the first 128 tokens' KV cut from a longer prefill are the bytes a clean
    128-token prefill writes."""
    prefill(adapter, prompt, [(0, len(prompt))])
    long_frag = adapter.extract_fragment(prompt, 0, 128)
    prefill(adapter, prompt[:128], [(0, 128)])
    short_frag = adapter.extract_fragment(prompt, 0, 128)
    assert np.array_equal(long_frag.keys.view(np.uint16), short_frag.keys.view(np.uint16))
    assert np.array_equal(long_frag.values.view(np.uint16), short_frag.values.view(np.uint16))


def test_one_token_batches_differ_and_the_prefill_plan_avoids_them(adapter, system_prompts):
    """Why the last prompt token is evaluated alone: llama.cpp's one-token evaluation can round
    differently from a batch (not on every prompt: on this one, found while building the
    router, by up to 0.55 in the logits), while batches of >= 2 agree to the bit."""
    prompt = adapter.tokenize(
        adapter.apply_chat_template(
            [
                {"role": "system", "content": system_prompts[0]},
                {
                    "role": "user",
                    "content": "Write a long, detailed essay about how to study well for exams, with many examples.",
                },
            ]
        )
    )
    n = len(prompt)
    full = prefill(adapter, prompt, [(0, n)])
    assert np.array_equal(prefill(adapter, prompt, [(0, 128), (128, n - 2), (n - 2, n)]), full)
    single = prefill(adapter, prompt, [(0, n - 1), (n - 1, n)])
    assert not np.array_equal(single, full)
    for n_past in (0, 64, n - 3, n - 1):
        plan = adapter.prefill_plan(n_past, n)
        assert plan[0][0] == n_past and plan[-1] == (n - 1, n)
        assert all(end - start >= 2 for start, end in plan[:-1])
        assert all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
    rule = adapter.injection_rule
    assert adapter.usable_prefix(n, n) == n - 1
    assert adapter.usable_prefix(n - 2, n) == usable_prefix(n - 2, n, int(adapter.llm.n_batch), rule) < n - 2
    assert adapter.usable_prefix(128, n) == 128 and adapter.usable_prefix(100, n) == 100 - 100 % rule.row_group


def test_smollm2s_kernels_compute_every_row_alike_so_any_cut_of_two_or_more_is_exact(adapter, prompt):
    """The load-time probe (``probe_rows``) finds SmolLM2's Q4_1 kernels row-independent here,
    and that holds on a real prompt: a stored prompt's batch ending at an odd point, then the
    rest from there, gives the uncached prefill's logits and KV bit for bit; a one-token
    batch in the middle does not always (why a first batch holds two tokens or more)."""
    assert adapter.injection_rule == ANY_ROW
    n, block = len(prompt), int(adapter.llm.n_batch)
    reference = prefill(adapter, prompt, adapter.prefill_plan(0, n))
    state = adapter._get_state()
    for cut in (101, 203, n - 3):
        assert adapter.usable_prefix(cut, n) == cut
        got = prefill(adapter, prompt, [(0, cut), *prefill_blocks(cut, n, block)])
        assert np.array_equal(got, reference) and adapter._get_state() == state


def test_the_row_probe_keeps_the_grouped_rule_when_a_cut_differs(adapter, monkeypatch):
    """A FAKE evaluation that differs after one cut (a fault this model does not show) makes
    the probe keep the default rule."""
    real = adapter._probe_eval

    def differs_after_a_cut(tokens, start, block):
        state, logits = real(tokens, start, block)
        return (state, logits if start == 0 else logits[:-1] + bytes([logits[-1] ^ 1]))

    monkeypatch.setattr(adapter, "_probe_eval", differs_after_a_cut)
    assert adapter.probe_rows() == GROUPED_ROWS
    assert adapter.n_tokens == 0


def test_injected_prefix_gives_the_logits_of_an_uncached_prefill(adapter, prompt):
    n = len(prompt)
    reference = prefill(adapter, prompt, adapter.prefill_plan(0, n))
    fragments = adapter.extract_fragments(prompt, [(0, 128), (128, 256), (256, n - 1)])
    for n_past in (128, 200, n - 1):
        adapter.clear_kv_cache()
        adapter.inject_fragment(fragments, n_past, prompt)
        assert adapter.llm.n_tokens == n_past
        for start, end in adapter.prefill_plan(n_past, n):
            adapter.llm.eval(prompt[start:end])
        assert np.array_equal(last_logits(adapter), reference), n_past


def test_long_states_move_in_chunks_with_the_bits_of_one_buffer(adapter, prompt, monkeypatch):
    """A state longer than ``STATE_CHUNK_BYTES`` is read and injected a chunk of cells at a time
    through the scratch sequence: the same fragments, the same seq state and logits as one buffer,
    and the injection buffer holds one chunk, not the context."""
    n = len(prompt)
    reference = prefill(adapter, prompt, adapter.prefill_plan(0, n))
    spans = [(0, 128), (128, 256), (256, n - 1)]
    whole = adapter.extract_fragments(prompt, spans)
    live_state = bytes(adapter._get_state(seq=0))
    cell = state_buffer.state_bytes(adapter._layout, 2) - state_buffer.state_bytes(adapter._layout, 1)
    monkeypatch.setattr(llamacpp, "STATE_CHUNK_BYTES", 256 * cell)  # 256 cells a chunk
    assert adapter._in_chunks() and adapter._chunk_cells() == 256 < n - 1
    chunked = adapter.extract_fragments(prompt, spans)
    for a, b in zip(whole, chunked):
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values)
    adapter.clear_kv_cache()
    adapter._state_buf = None
    adapter.inject_fragment(whole, n - 1, prompt)
    assert len(adapter._state_buf) == state_buffer.state_bytes(adapter._layout, 256)
    adapter.llm.eval(prompt[n - 1:])
    assert np.array_equal(last_logits(adapter), reference)
    assert bytes(adapter._get_state()) == live_state


def test_inject_validates_before_touching_the_engine(adapter, prompt):
    n = len(prompt)
    prefill(adapter, prompt, [(0, n)])
    fragments = adapter.extract_fragments(prompt, [(0, 128), (128, 256)])
    other = list(prompt)
    other[130] = (other[130] + 1) % 49152
    with pytest.raises(ValueError, match="token_ids"):
        adapter.inject_fragment(fragments, 200, other)
    with pytest.raises(ValueError, match="no KV for layer"):
        adapter.inject_fragment(fragments[:1], 200, prompt)
    assert adapter.llm.n_tokens == n  # the live sequence was left alone


def test_generate_refuses_a_prompt_over_the_context(adapter):
    tokens = [1000] * (adapter.n_ctx - 10)
    with pytest.raises(ContextOverflowError) as info:
        next(adapter.generate(tokens, 0, max_tokens=32))
    assert info.value.prompt_tokens == adapter.n_ctx - 10 and info.value.max_tokens == 32
    assert str(adapter.n_ctx - 10) in str(info.value) and "32" in str(info.value)


def test_a_context_below_llama_cpps_rounding_is_the_one_asked_for():
    """llama.cpp rounds a 64-token context up to 256 cells, but llama-cpp-python's token buffer
    holds 64: the adapter's n_ctx is 64, so a 100-token prompt is refused with the numbers
    instead of failing inside llama-cpp-python."""
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter

    small = LlamaCppAdapter(n_ctx=64, n_threads=1)
    try:
        assert small.llm.n_ctx() > 64 and small.n_ctx == 64
        with pytest.raises(ContextOverflowError) as info:
            next(small.generate([1000] * 100, 0, max_tokens=3))
        assert "64" in str(info.value) and "103" in str(info.value)
        tokens = list(small.generate([1000] * 40, 0, max_tokens=3))
        assert 1 <= len(tokens) <= 3
    finally:
        small.close()


def test_clear_kv_cache_empties_the_sequence(adapter, prompt):
    prefill(adapter, prompt[:80], [(0, 80)])
    assert llama_cpp.llama_memory_seq_pos_max(adapter._mem, 0) == 79
    adapter.clear_kv_cache()
    assert llama_cpp.llama_memory_seq_pos_max(adapter._mem, 0) == -1
    assert adapter.llm.n_tokens == 0
    assert llama_cpp.llama_state_seq_get_size(adapter._ctx, 0) < 64


def test_the_thread_count_changes_no_bit_of_the_logits_or_the_answer(adapter, prompt):
    """``set_threads`` between evaluations (a server's workers share the CPUs that way,
    ``server/core_share.py``): the prompt's last logits and a greedy answer are bit-identical on
    1 and 2 threads."""
    outcomes = []
    try:
        for threads in (1, 2):
            adapter.set_threads(threads)
            logits = prefill(adapter, prompt, [(0, len(prompt))])
            adapter.clear_kv_cache()
            answer = list(adapter.generate(prompt, 0, max_tokens=16, temperature=0.0))
            outcomes.append((logits.tobytes(), answer))
    finally:
        adapter.set_threads(adapter.llm.context_params.n_threads)
        adapter.clear_kv_cache()
    assert outcomes[0][1] and outcomes[0] == outcomes[1]
    with pytest.raises(ValueError, match="n_threads"):
        adapter.set_threads(0)


def test_the_kernel_digest_is_one_across_threads_contexts_and_batches(adapter, prompt):
    """The kernel digest in the namespace is what the probe measures, again and again, on 1
    or 2 threads, and in another context size and sequence count: KV keeps being
    shared between this machine's processes whatever their settings; the probe starts from
    and leaves an empty KV memory."""
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter

    digests = {adapter.namespace.kernels}
    try:
        for threads in (1, 2):
            adapter.set_threads(threads)
            digests.add(adapter.probe_kernels())
            assert adapter.n_tokens == 0
    finally:
        adapter.set_threads(adapter.llm.context_params.n_threads)
    other = LlamaCppAdapter(n_ctx=1024, n_threads=1, n_seq_max=1, kv_unified=False)
    try:
        digests.add(other.probe_kernels())
    finally:
        other.close()
    assert len(digests) == 1 and len(adapter.namespace.kernels) == 64


def test_prefill_batches_cut_for_the_workers_turns_change_no_bit(adapter, prompt):
    """``kv_layout.turn_batches`` (a server's workers take turns between the pieces): from the
    start and after an injection point, the KV state and the last logits equal the plan's; and
    ``generate`` with ``turn_tokens`` set gives the same answer."""
    tokens = (prompt * 12)[:900]
    n = len(tokens)
    for n_past in (0, usable_prefix(300, n, 512)):
        # the live part as an injection leaves it: the uncached plan's batches, cut at n_past
        head = [(s, min(e, n_past)) for s, e in adapter.prefill_plan(0, n) if s < n_past]
        plan = adapter.prefill_plan(n_past, n)
        pieces = turn_batches(plan, 128)
        assert len(pieces) > len(plan)
        whole = prefill(adapter, tokens, head + plan), adapter._get_state()
        cut = prefill(adapter, tokens, head + pieces), adapter._get_state()
        assert np.array_equal(whole[0], cut[0]) and whole[1] == cut[1], n_past
    answers = []
    try:
        for every in (0, 128):
            adapter.turn_tokens = every
            adapter.clear_kv_cache()
            answers.append(list(adapter.generate(tokens, 0, max_tokens=8, temperature=0.0)))
    finally:
        adapter.turn_tokens = 0
        adapter.clear_kv_cache()
    assert answers[0] and answers[0] == answers[1]


def test_more_threads_than_cpus_load_with_one_warning(adapter, prompt, caplog):
    """``n_threads`` above the CPUs this process may run on (an ``EDGESYNC_THREADS`` copied from
    a bigger machine): the engine loads with one warning naming both counts, and answers as the
    shared engine does."""
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
    from edgesync_engines.adapters.threads import usable_cpus

    cpus = usable_cpus()
    with caplog.at_level("WARNING", logger="edgesync_engines.adapters.llamacpp"):
        crowded = LlamaCppAdapter(n_ctx=512, n_threads=cpus + 1)
    try:
        warned = [r.getMessage() for r in caplog.records if "n_threads" in r.getMessage()]
        assert len(warned) == 1 and f"n_threads {cpus + 1} " in warned[0] and f"the {cpus} CPUs" in warned[0]
        answer = list(crowded.generate(prompt, 0, max_tokens=8, temperature=0.0))
    finally:
        crowded.close()
    adapter.clear_kv_cache()
    assert answer and answer == list(adapter.generate(prompt, 0, max_tokens=8, temperature=0.0))
    adapter.clear_kv_cache()


@pytest.fixture(scope="module")
def flash():
    """SmolLM2 with flash attention on (2,048-token context), for this module."""
    from edgesync_engines.adapters.llamacpp import LlamaCppAdapter

    a = LlamaCppAdapter(n_ctx=2048, flash_attn=True)
    yield a
    a.close()


def test_flash_attention_hits_are_bit_identical_when_every_batch_holds_a_tile(flash, system_prompts):
    """Flash attention's CPU kernel computes a row alone, by a tiled path in batches of 64
    tokens or more and a per-row path below (other bits). The tiled rule keeps every prefill
    batch at 64 or more: a prompt stored with a tail of 27 to 127 tokens after the grid, then a
    700-token prompt from the point ``usable_prefix`` gives, has the uncached prefill's KV state
    and last logits bit for bit, and the same greedy answer; so do the workers' turn pieces. A
    first batch of 39 tokens (the grid plan without the rule) does not."""
    assert flash.injection_rule == tiled_rule(ANY_ROW)
    tokens = flash.tokenize("\n\n".join(system_prompts))[:700]
    n = len(tokens)
    assert flash.prefill_plan(0, n) == [(0, 512), (512, 699), (699, 700)]
    assert flash.usable_prefix(60, 61) == 0  # an uncached 61-token prompt runs the per-row path
    flash.prefill(tokens)
    reference = last_logits(flash), flash._get_state()
    answer = list(flash.generate(tokens, n - 1, max_tokens=16, temperature=0.0))
    for stored, available, usable in ((601, 600, 600), (640, 639, 635), (540, 539, 539), (n, n - 1, n - 1)):
        assert flash.usable_prefix(available, n) == usable
        flash.prefill(tokens[:stored])  # the stored prompt's KV, live; the hit starts from its first tokens
        flash.prefill(tokens, usable)
        assert np.array_equal(last_logits(flash), reference[0]) and flash._get_state() == reference[1], stored
        if stored in (601, n):
            flash.prefill(tokens[:stored])
            assert list(flash.generate(tokens, usable, max_tokens=16, temperature=0.0)) == answer
    pieces = turn_batches(flash.prefill_plan(0, n), 64, flash.injection_rule)
    assert len(pieces) > 3 and np.array_equal(prefill(flash, tokens, pieces), reference[0])
    assert flash._get_state() == reference[1]
    short_first = prefill(flash, tokens, [(0, 660), (660, 699), (699, 700)])
    assert not np.array_equal(short_first, reference[0])
    flash.clear_kv_cache()
