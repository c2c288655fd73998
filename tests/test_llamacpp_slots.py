"""Slots on the real SmolLM2: several sequences of one llama.cpp context, their steps batched in
one loop, each bit-identical to the same request answered alone by the plain adapter."""

from __future__ import annotations

import ctypes
import threading

import llama_cpp
import numpy as np
import pytest

from edgesync_engines.adapters.kv_layout import turn_batches
from edgesync_engines.adapters.llamacpp import LlamaCppAdapter
from edgesync_engines.adapters.llamacpp_slots import SlotEngine
from edgesync_engines.adapters.protocol import ContextOverflowError
from edgesync_engines.adapters.step_loop import END, Job

pytestmark = [pytest.mark.model]

N_CTX = 1024
STEPS = 24


@pytest.fixture(scope="module")
def engine():
    e = SlotEngine(None, slots=3, n_ctx=N_CTX, n_threads=2)
    yield e
    e.close()


@pytest.fixture(scope="module")
def alone():
    a = LlamaCppAdapter(None, n_ctx=N_CTX, n_threads=2)
    yield a
    a.close()


def chat(adapter, system: str, question: str) -> list[int]:
    return adapter.tokenize(adapter.apply_chat_template([{"role": "system", "content": system},
                                                         {"role": "user", "content": question}]))


def logits_alone(adapter: LlamaCppAdapter, tokens: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the float32 logits each came from, the prompt prefilled by the plain
    adapter's own plan, then one token at a time."""
    n_vocab = adapter.llm.n_vocab()

    def last() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(adapter.llm.ctx, -1), shape=(n_vocab,)).copy()

    adapter.prefill(tokens)
    seq, out, logits = list(tokens), [], []
    for _ in range(steps):
        logits.append(last())
        out.append(int(np.argmax(logits[-1])))
        seq.append(out[-1])
        adapter.extend(seq, len(seq) - 1, len(seq))
    adapter.clear_kv_cache()
    return out, logits


def greedy():
    """llama.cpp's greedy sampler chain (free it with ``llama_sampler_free``)."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    return chain


def test_every_slots_decode_row_may_share_a_step_here(engine):
    assert engine.shared_rows == 3  # SmolLM2's kernels: a row's logits do not depend on the others


def test_two_sequences_share_steps_and_keep_the_logits_of_each_alone(engine, alone, system_prompts):
    """B decodes while A's prompt is prefilled in 64-token chunks, one chunk a step; then both
    decode together. Every logit of both is bit-identical to each answered alone."""
    a_tokens = chat(alone, system_prompts[0], "How do I revise for a chemistry test?")
    b_tokens = chat(alone, system_prompts[1], "Write a haiku about tea.")
    assert len(a_tokens) > 3 * 64
    ref_a, ref_a_logits = logits_alone(alone, a_tokens, STEPS)
    ref_b, ref_b_logits = logits_alone(alone, b_tokens, 4 * STEPS)

    slot_a, slot_b = engine.adapters[0], engine.adapters[1]
    for slot in (slot_a, slot_b):
        slot.clear_kv_cache()
    loop = engine.loop
    steps_before = loop.steps
    b_prefill = slot_b.prefill_plan(0, len(b_tokens))
    for start, end in b_prefill[:-1]:
        slot_b.extend(b_tokens, start, end)
    sampler_b = greedy()
    start = b_prefill[-1][0]
    job_b = loop.submit(Job(1, b_tokens[start:], start, sampler_b, 4 * STEPS, slot_b.is_eog, keep_logits=True))
    assert job_b.tokens.get() != END  # B decodes from here on while A prefills

    # the plain adapter's plan but its last token, cut into 64-token chunks (cuts that keep the
    # KV bit-identical on SmolLM2: kv_layout.turn_batches)
    a_plan = turn_batches(slot_a.prefill_plan(0, len(a_tokens))[:-1], 64, slot_a.injection_rule)
    b_steps = next((i for i, t in enumerate(ref_b) if slot_b.is_eog(t)), len(ref_b))
    assert b_steps > len(a_plan) + 1  # B decodes for longer than A's chunks take: they overlap
    for s, e in a_plan:  # one chunk per step, beside B's decode row
        loop.submit(Job(0, a_tokens[s:e], s)).wait()
    assert not job_b.done.is_set()  # B was still decoding: the chunks shared its steps
    sampler_a = greedy()
    n = len(a_tokens)
    job_a = loop.submit(Job(0, a_tokens[n - 1:], n - 1, sampler_a, STEPS, slot_a.is_eog, keep_logits=True))
    job_a.wait()
    job_b.wait()
    out_a = [job_a.tokens.get() for _ in range(len(job_a.logits))]
    for sampler in (sampler_a, sampler_b):
        llama_cpp.llama_sampler_free(sampler)
    for slot in (slot_a, slot_b):
        slot.clear_kv_cache()

    assert out_a == ref_a[:len(out_a)] and len(out_a) == STEPS
    assert all(np.array_equal(x, y) for x, y in zip(job_a.logits, ref_a_logits))
    ends = [i for i, t in enumerate(ref_b) if slot_b.is_eog(t)]  # B stops at its end-of-generation token
    assert len(job_b.logits) == (ends[0] + 1 if ends else len(ref_b))
    assert all(np.array_equal(x, y) for x, y in zip(job_b.logits, ref_b_logits))
    # fewer steps than evaluations one by one: the sequences shared them
    assert loop.steps - steps_before < len(a_plan) + STEPS + 4 * STEPS


def test_generate_in_threads_equals_each_alone_and_shares_steps(engine, alone, system_prompts):
    questions = ["What is photosynthesis?", "Name three rivers in Europe.", "How do magnets work?"]
    prompts = [chat(alone, system_prompts[i], q) for i, q in enumerate(questions)]
    expected = [list(alone.generate(p, 0, 32)) for p in prompts]
    alone.clear_kv_cache()
    got: list[list[int] | None] = [None] * 3

    def answer(i: int) -> None:
        slot = engine.adapters[i]
        with slot.lock:
            got[i] = list(slot.generate(prompts[i], 0, 32))

    steps_before = engine.loop.steps
    threads = [threading.Thread(target=answer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected
    assert engine.loop.steps - steps_before < sum(len(e) for e in expected)
    for i, slot in enumerate(engine.adapters):  # its prompt and answer (but the last at max_tokens)
        held = expected[i][:-1] if len(expected[i]) == 32 else expected[i]
        assert slot.live_tokens() == prompts[i] + held


def test_cancelling_one_sequence_leaves_the_other_identical(engine, alone, system_prompts):
    p0 = chat(alone, system_prompts[2], "Explain recursion with an example.")
    p1 = chat(alone, system_prompts[3], "Describe a good breakfast.")
    expected0 = list(alone.generate(p0, 0, 48))
    expected1 = list(alone.generate(p1, 0, 48))
    alone.clear_kv_cache()
    out1: list[int] = []
    slot0, slot1 = engine.adapters[0], engine.adapters[1]

    def answer1() -> None:
        with slot1.lock:
            out1.extend(slot1.generate(p1, 0, 48))

    t = threading.Thread(target=answer1)
    t.start()
    with slot0.lock:
        stream = slot0.generate(p0, 0, 48)
        first = [next(stream) for _ in range(5)]
        stream.close()  # cancelled mid-answer
    t.join()
    assert first == expected0[:5]
    assert out1 == expected1
    held = slot0.live_tokens()
    assert held[:len(p0)] == p0 and len(p0) + 4 <= len(held) <= len(p0) + 5
    assert held[len(p0):] == expected0[:len(held) - len(p0)]


def test_fragments_move_between_slots_and_the_plain_adapter(engine, alone, system_prompts):
    """KV cut from one slot injects into another and into the plain adapter (one namespace):
    the answers after it equal an uncached run's."""
    tokens = chat(alone, system_prompts[4], "What should I pack for a hike?")
    expected = list(alone.generate(tokens, 0, 16))
    assert engine.adapters[0].namespace == alone.namespace
    slot0, slot2 = engine.adapters[0], engine.adapters[2]
    slot0.prefill(tokens)
    fragments = slot0.extract_fragments(tokens, [(0, len(tokens) - 1)])
    slot0.clear_kv_cache()
    for target in (slot2, alone):
        target.inject_fragment(fragments, len(tokens) - 1, tokens)
        assert list(target.generate(tokens, len(tokens) - 1, 16)) == expected
        target.clear_kv_cache()


def test_a_slot_refuses_a_prompt_beyond_its_own_context(engine):
    with pytest.raises(ContextOverflowError):
        next(engine.adapters[0].generate([1] * (N_CTX - 4), 0, 8))


def test_a_slots_state_is_one_stream_of_several_and_round_trips(engine, alone, system_prompts):
    """llama.cpp writes a slot's sequence as ``slots`` streams, its cells in its own: the parser
    reads it, and the reference writer gives back the same bytes."""
    from seqstate_writer import serialize_parts

    from edgesync_engines.adapters import seqstate

    tokens = chat(alone, system_prompts[5], "Give me one tip.")
    slot = engine.adapters[2]
    slot.prefill(tokens)
    size = llama_cpp.llama_state_seq_get_size(engine.owner.llm.ctx, 2)
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data(engine.owner.llm.ctx, buf, size, 2) == size
    slot.clear_kv_cache()
    parts = seqstate.parse_parts(bytes(buf))
    assert [p.n_stream for p in parts] == [3] and parts[0].pos.tolist() == list(range(len(tokens)))
    assert bytes(serialize_parts(parts, seq_id=2, stream=2)) == bytes(buf)


def test_a_gap_between_answering_slots_is_filled_and_the_idle_slot_keeps_its_kv(engine, alone, system_prompts):
    """Slots 0 and 2 answer while slot 1 holds a prompt: the step fills slot 1's id with a
    throw-away row (so llama.cpp keeps both rows in one micro-batch) and removes it. Both answers
    equal their uncached ones, and slot 1 then continues its prompt to the uncached answer."""
    prompts = [chat(alone, system_prompts[i], q) for i, q in
               enumerate(("Describe a forest.", "What is a verb?", "How do tides work?"))]
    expected = [list(alone.generate(p, 0, 24)) for p in prompts]
    alone.clear_kv_cache()
    slots = engine.adapters
    slots[1].extend(prompts[1], 0, len(prompts[1]) - 1)  # the batch an uncached prefill evaluates
    held = slots[1].live_tokens()
    got: dict[int, list[int]] = {}

    def answer(i: int) -> None:
        with slots[i].lock:
            got[i] = list(slots[i].generate(prompts[i], 0, 24))

    threads = [threading.Thread(target=answer, args=(i,)) for i in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {0: expected[0], 2: expected[2]}
    assert slots[1].live_tokens() == held
    assert list(slots[1].generate(prompts[1], len(prompts[1]) - 1, 24)) == expected[1]
