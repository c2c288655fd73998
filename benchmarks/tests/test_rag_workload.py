"""The rag workload (``edgesync_engines/app/rag_workload.py``) on the real doc_qa data: the
recipe is deterministic, and every request's gold passage, question and answers line up."""

from __future__ import annotations

import json
import random

import pytest

from edgesync_bench.rag_workload import RAG_SYSTEM_PROMPT, rag_corpus, rag_workload


@pytest.fixture(scope="module")
def doc_qa(data_dir):
    rows = [json.loads(line) for line in (data_dir / "doc_qa.jsonl").read_text().splitlines() if line.strip()]
    answers = {json.loads(line)["doc_id"]: json.loads(line)["answers"]
               for line in (data_dir / "doc_qa_answers.jsonl").read_text().splitlines() if line.strip()}
    return rows, answers


@pytest.fixture(scope="module")
def requests(data_dir):
    return rag_workload(200, data_dir)


def test_corpus_is_every_passage_in_file_order(doc_qa, data_dir):
    rows, _ = doc_qa
    corpus = rag_corpus(data_dir)
    assert len(corpus) == 181
    assert [d["source"] for d in corpus] == [r["doc_id"] for r in rows]
    assert all(d["text"] == r["context"] and d["title"] == r["title"] for d, r in zip(corpus, rows))


def test_deterministic_and_200_requests(requests, data_dir):
    assert len(requests) == 200
    assert [r.request_id for r in requests[:3]] == ["rag-0000", "rag-0001", "rag-0002"]
    assert rag_workload(200, data_dir) == requests
    assert rag_workload(5, data_dir) == requests[:5]


def test_gold_among_four_distinct_documents(requests):
    for req in requests:
        sources = [d["source"] for d in req.documents]
        assert len(sources) == 4 and len(set(sources)) == 4
        assert sources.count(req.gold_doc) == 1
        assert [m["role"] for m in req.messages] == ["system", "user"]
        assert req.messages[0]["content"] == RAG_SYSTEM_PROMPT
    # the shuffle puts the gold passage at every one of the 4 places
    assert {[d["source"] for d in r.documents].index(r.gold_doc) for r in requests} == {0, 1, 2, 3}


def test_answers_line_up_with_the_answers_file(requests, doc_qa):
    rows, answers = doc_qa
    by_id = {r["doc_id"]: r for r in rows}
    for i, req in enumerate(requests):
        row = by_id[req.gold_doc]
        j = row["questions"].index(req.messages[-1]["content"])
        assert list(req.answers) == [str(a) for a in answers[req.gold_doc][j]]
        # the recipe of the module docstring, recomputed here
        rng = random.Random(i)
        assert rows[rng.randrange(len(rows))]["doc_id"] == req.gold_doc


def test_bad_n_is_refused(data_dir):
    with pytest.raises(ValueError, match="n must be >= 1"):
        rag_workload(0, data_dir)
