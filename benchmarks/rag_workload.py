"""The ``rag`` workload: retrieved passages in a new order before each question.

Built from ``doc_qa.jsonl`` and ``doc_qa_answers.jsonl`` (all 181 rows of each, file order),
deterministic:

* the corpus is every passage (:func:`rag_corpus`: ``{"text", "title", "source"}`` per row,
  ``source`` the row's ``doc_id``), added to the store before the first request;
* request i (i = 0..199) takes ``rng = random.Random(i)``: a passage p =
  ``rng.randrange(181)``, one of its questions ``rng.randrange(len(questions))`` (gold answers
  from ``doc_qa_answers.jsonl``), then 3 other passages ``rng.sample`` (without replacement)
  as distractors; the 4 passages are shuffled with ``rng.shuffle``.

Each request is the chat ``[system RAG_SYSTEM_PROMPT, user question]`` with the 4 passages
as its ``documents`` (``EdgeSync.generate(messages, documents=...)`` places them before the
question).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from edgesync_bench.workloads import WorkloadDataError, data_file, read_jsonl

RAG_SYSTEM_PROMPT = "Answer the question using the documents. Reply briefly."
RAG_REQUESTS = 200
RAG_DISTRACTORS = 3
DOC_QA_FILE = "doc_qa.jsonl"
ANSWERS_FILE = "doc_qa_answers.jsonl"


@dataclass(frozen=True)
class RagRequest:
    """One rag request.

    Fields: ``request_id`` (``"rag-0007"``), ``messages`` (system + user question),
    ``documents`` (4 corpus entries, shuffled), ``gold_doc`` (the ``source`` of the passage the
    question is about), ``answers`` (its gold answers, strings).
    """

    request_id: str
    messages: tuple
    documents: tuple
    gold_doc: str
    answers: tuple

    def as_messages(self) -> list[dict]:
        """The messages as new dicts."""
        return [dict(m) for m in self.messages]


def rag_corpus(data_dir: str | os.PathLike | None = None) -> list[dict]:
    """Every passage of ``doc_qa.jsonl`` as a document dict, in file order.

    Raises:
        WorkloadDataError: the file is missing or a row lacks its strings.
    """
    path = data_file(DOC_QA_FILE, data_dir)
    out = []
    for lineno, row in enumerate(read_jsonl(path), start=1):
        if not all(isinstance(row.get(k), str) for k in ("doc_id", "title", "context")):
            raise WorkloadDataError(f"{path}:{lineno}: 'doc_id', 'title' and 'context' must be strings")
        out.append({"text": row["context"], "title": row["title"], "source": row["doc_id"]})
    return out


def rag_workload(n: int = RAG_REQUESTS, data_dir: str | os.PathLike | None = None) -> list[RagRequest]:
    """The first ``n`` requests of the workload (module docstring).

    Raises:
        ValueError: ``n`` < 1.
        WorkloadDataError: missing or malformed data, or answers that do not line up with the
            questions.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    corpus = rag_corpus(data_dir)
    rows = read_jsonl(data_file(DOC_QA_FILE, data_dir))
    answers = {r.get("doc_id"): r.get("answers") for r in read_jsonl(data_file(ANSWERS_FILE, data_dir))}
    out = []
    for i in range(n):
        rng = random.Random(i)
        p = rng.randrange(len(rows))
        questions = rows[p]["questions"]
        j = rng.randrange(len(questions))
        gold = answers.get(rows[p]["doc_id"])
        if not isinstance(gold, list) or len(gold) != len(questions):
            raise WorkloadDataError(f"{ANSWERS_FILE}: no answers for {rows[p]['doc_id']} question {j}")
        others = rng.sample([k for k in range(len(rows)) if k != p], RAG_DISTRACTORS)
        picks = [p, *others]
        rng.shuffle(picks)
        out.append(RagRequest(
            request_id=f"rag-{i:04d}",
            messages=({"role": "system", "content": RAG_SYSTEM_PROMPT}, {"role": "user", "content": questions[j]}),
            documents=tuple(corpus[k] for k in picks),
            gold_doc=rows[p]["doc_id"],
            answers=tuple(str(a) for a in gold[j]),
        ))
    return out
