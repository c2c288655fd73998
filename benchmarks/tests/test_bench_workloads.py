"""Tests for edgesync_bench.bench_workloads (no model; fast).

Data: ../shared/workloads/ (or $EDGESYNC_WORKLOADS): the seed workload as in
edgesync_bench.workloads (qqp_clusters.jsonl all rows + system_prompts.json, Random(0));
doc_qa.jsonl (40 rows, sorted(random.Random(0).sample(range(181), 40))); chat_sessions.jsonl
(40 rows, sorted(random.Random(0).sample(range(500), 40))).

The chat tests have no model: the answers fed back are fixed fake strings standing in for the
model's text, and the token counter is a stand-in (characters // 4 of the joined contents plus
8 a message), not the model's tokenizer. They test the session's bookkeeping, not the model.
"""

from __future__ import annotations

import json
import random

import pytest

from edgesync_bench import bench_workloads as bw
from edgesync_bench.workloads import DOC_QA_SYSTEM_PROMPT, doc_qa_workload, seed_workload


def fake_count(messages) -> int:
    """Stand-in token counter: chars // 4 of every content plus 8 tokens a message."""
    return sum(len(m["content"]) // 4 + 8 for m in messages)


def fake_answer(session, turn) -> str:
    """Fixed fake answer standing in for the model's text (no model runs here)."""
    return f"FAKE-ANSWER[{session.session_id}|{turn.turn}]"


def run_fake(sessions):
    """Drive every session to its end with fake answers; return all turns served."""
    turns = []
    for s in sessions:
        while (t := s.next_prompt()) is not None:
            turns.append(t)
            s.record_answer(fake_answer(s, t))
    return turns


# -- seed --------------------------------------------------------------------------------


def test_seed_is_the_engine_workload():
    reqs = bw.seed_requests()
    assert len(reqs) == 1000
    assert reqs == seed_workload(1000)
    assert all(r.prompt_key and r.group.startswith("topic-") for r in reqs)


def test_seed_slow_systems_take_a_prefix():
    full = bw.seed_requests()
    part = bw.seed_requests(bw.SLOW_SYSTEM_LIMIT)
    assert len(part) == 300 and part == full[:300]
    with pytest.raises(ValueError):
        bw.seed_requests(0)
    with pytest.raises(ValueError):
        bw.seed_requests(1001)


# -- doc-QA ------------------------------------------------------------------------------


def test_doc_qa_has_40_sampled_passages_questions_in_file_order(data_dir):
    reqs = bw.doc_qa_requests()
    rows = [json.loads(line) for line in (data_dir / "doc_qa.jsonl").open(encoding="utf-8")]
    chosen = sorted(random.Random(0).sample(range(len(rows)), 40))
    groups = list(dict.fromkeys(r.group for r in reqs))
    assert len(groups) == 40 == len(set(groups))
    assert groups == [rows[i]["doc_id"] for i in chosen]  # passages in file order
    for i in chosen:
        row = rows[i]
        mine = [r for r in reqs if r.group == row["doc_id"]]
        # each passage's questions are successive requests, in file order
        first = reqs.index(mine[0])
        assert reqs[first:first + len(mine)] == mine
        assert [r.messages[1]["content"].rsplit("Question: ", 1)[1] for r in mine] == row["questions"]
        assert [r.prompt_key for r in mine] == [f"{row['doc_id']}#q{j}" for j in range(len(mine))]
        assert all(r.messages[0]["content"] == DOC_QA_SYSTEM_PROMPT for r in mine)
        assert all(row["context"] in r.messages[1]["content"] for r in mine)
    assert [r.request_id for r in reqs] == [f"doc-qa-{i:04d}" for i in range(len(reqs))]
    assert len({r.prompt_key for r in reqs}) == len(reqs)


def test_smaller_samples_are_subsets_of_the_40_drawn(data_dir):
    """The full bench run's 10 passages and 10 sessions are the first 10 of the same 40-row
    draws, so every passage or session it runs is one the 40-row run had."""
    full = bw.doc_qa_requests()
    part = bw.doc_qa_requests(bw.BENCH_DOC_QA_PASSAGES)
    groups = list(dict.fromkeys(r.group for r in part))
    assert len(groups) == 10 and len(part) == 48
    assert [r.messages for r in part] == [r.messages for r in full if r.group in set(groups)]
    rows = [json.loads(line) for line in (data_dir / "doc_qa.jsonl").open(encoding="utf-8")]
    draw = random.Random(0).sample(range(len(rows)), 40)[:10]
    assert groups == [rows[i]["doc_id"] for i in sorted(draw)]
    sessions = bw.chat_sessions(fake_count, bw.BENCH_CHAT_SESSIONS)
    all_ids = [s.session_id for s in bw.chat_sessions(fake_count)]
    ids = [s.session_id for s in sessions]
    assert len(ids) == 10 and set(ids) <= set(all_ids) and ids == [i for i in all_ids if i in set(ids)]
    assert sum(s.n_turns for s in sessions) == 29


def test_doc_qa_first_rows_option_equals_engine_workload():
    assert bw.doc_qa_requests(seed=None) == doc_qa_workload(40)


# -- chat --------------------------------------------------------------------------------


def test_chat_has_40_sampled_sessions(data_dir):
    rows = [json.loads(line) for line in (data_dir / "chat_sessions.jsonl").open(encoding="utf-8")]
    chosen = sorted(random.Random(0).sample(range(len(rows)), 40))
    sessions = bw.chat_sessions(fake_count)
    assert [s.session_id for s in sessions] == [rows[i]["session_id"] for i in chosen]
    assert [list(s.user_turns) for s in sessions] == [rows[i]["turns"] for i in chosen]


def test_chat_answers_feed_back_and_prompts_grow():
    sessions = bw.chat_sessions(fake_count)
    multi = [s for s in sessions if s.n_turns >= 3][:5]
    assert multi
    for s in multi:
        prev, prev_tokens = None, 0
        while (t := s.next_prompt()) is not None:
            msgs = t.messages
            assert msgs[-1] == {"role": "user", "content": s.user_turns[t.turn]}
            assert t.group == s.session_id and t.prompt_key == f"{s.session_id}#t{t.turn}"
            assert t.max_tokens == 16
            # all earlier fake answers, in order, as the assistant turns
            assert [m["content"] for m in msgs if m["role"] == "assistant"] == s.answers
            assert [m["role"] for m in msgs] == ["user", "assistant"] * t.turn + ["user"]
            if prev is not None:
                assert msgs[: len(prev)] == prev  # previous prompt is a prefix
                assert len(msgs) == len(prev) + 2
                assert t.prompt_tokens > prev_tokens
            prev, prev_tokens = msgs, t.prompt_tokens
            s.record_answer(fake_answer(s, t))
        assert s.done and (s.served_turns == s.n_turns or s.overflowed)


def test_chat_protocol_errors():
    s = bw.ChatSession("x", ["a", "b"], fake_count)
    with pytest.raises(RuntimeError):
        s.record_answer("no prompt pending")
    t = s.next_prompt()
    with pytest.raises(RuntimeError):
        s.next_prompt()
    with pytest.raises(TypeError):
        s.record_answer(None)
    s.record_answer("ok")
    assert s.next_prompt().turn == 1
    s.record_answer("ok2")
    assert s.next_prompt() is None and s.done and s.served_turns == 2 and t.turn == 0


def test_chat_overflow_cut_off_is_counted():
    # 1,000 chars = 258 stand-in tokens a user message; answers add 8 + len // 4.
    turns = ["u" * 1000] * 5
    s = bw.ChatSession("ovf", turns, fake_count, n_ctx=600, max_tokens=16)
    served = []
    while (t := s.next_prompt()) is not None:
        assert t.prompt_tokens + 16 <= 600
        served.append(t)
        s.record_answer("a" * 40)
    # turn 0: 258; turn 1: 258 + 18 + 258 = 534 (+16 = 550 fits); turn 2: 810 > 584
    assert [t.turn for t in served] == [0, 1]
    assert s.overflowed and s.cut_turns == 3 and s.done
    assert s.next_prompt() is None  # stays over

    # a first turn larger than the context: no turn served, all counted as cut
    big = bw.ChatSession("big", ["x" * 20000, "y"], fake_count, n_ctx=4096)
    assert big.next_prompt() is None and big.overflowed and big.cut_turns == 2
    assert big.served_turns == 0


def test_chat_real_long_turns_are_cut_not_crashed():
    sessions = bw.chat_sessions(fake_count, n_sessions=500)  # all rows: some pasted turns > 20k chars
    run_fake(sessions)
    cut = [s for s in sessions if s.overflowed]
    assert cut, "expected the README's over-long pasted turns to be cut"
    for s in sessions:
        assert s.served_turns + s.cut_turns == s.n_turns


def test_adapter_token_counter_uses_template_and_tokenizer():
    class Stub:  # stand-in adapter: template joins contents, tokenizer splits on spaces
        def apply_chat_template(self, messages):
            return " ".join(m["content"] for m in messages) + " <gen>"

        def tokenize(self, text):
            return text.split()

    count = bw.adapter_token_counter(Stub())
    assert count([{"role": "user", "content": "a b c"}]) == 4


# -- determinism -------------------------------------------------------------------------


def test_two_builds_are_equal():
    assert bw.seed_requests() == bw.seed_requests()
    assert bw.doc_qa_requests() == bw.doc_qa_requests()
    a, b = run_fake(bw.chat_sessions(fake_count)), run_fake(bw.chat_sessions(fake_count))
    assert a == b and len(a) > 40
    assert len({t.prompt_key for t in a}) == len(a)
    assert len({t.request_id for t in a}) == len(a)
