"""Which tokens a blend recomputes (``request/blend.py`` ``recompute_runs``) and the prompt layout
it works on (``request/documents.py`` ``build_prompt``): pure logic, on the fake adapter of
``tests/fake_adapter.py`` (one token per character; not an engine). The real-model blend is
tested in ``test_documents.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fake_adapter import FakeAdapter

from edgesync_engines.request.blend import recompute_runs
from edgesync_engines.request.documents import SEPARATOR, build_prompt, text_windows
from edgesync_store.documents.records import DocumentRecord


def rec(text: str) -> DocumentRecord:
    return DocumentRecord(b"\0" * 32, np.array([ord(c) for c in text], np.int32), np.zeros(0, np.int32), "", "",
                          text, 0.0)


MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]


def test_the_prompt_is_head_documents_separators_question():
    adapter = FakeAdapter()
    docs = [rec("alpha"), rec("be"), rec("gamma!")]
    prompt = build_prompt(adapter, MESSAGES, docs)
    text = "".join(map(chr, prompt.tokens))
    head = adapter.apply_chat_template(MESSAGES).split("Q?")[0]
    assert text == head + "alpha" + SEPARATOR + "be" + SEPARATOR + "gamma!" + SEPARATOR + "Q?" + \
        adapter.apply_chat_template(MESSAGES).split("Q?")[1]
    assert prompt.head_len == len(head)
    assert [off for _, off in prompt.pieces] == [len(head), len(head) + 7, len(head) + 11]
    assert prompt.question_start == len(head) + 17
    with pytest.raises(ValueError, match="ending with the user's question"):
        build_prompt(adapter, MESSAGES[:1], docs)


@pytest.mark.parametrize("share", [0.0, 0.15, 0.5, 1.0])
def test_runs_cover_each_separator_and_the_first_share_of_each_document(share):
    prompt = build_prompt(FakeAdapter(), MESSAGES, [rec("a" * 100), rec("b" * 40), rec("c" * 7)])
    runs = recompute_runs(prompt, [True, True, True], share)
    (_, o1), (_, o2), (_, o3) = prompt.pieces
    want = [(o1, o1 + math.ceil(share * 100)), (o1 + 100, o2 + math.ceil(share * 40)),
            (o2 + 40, o3 + math.ceil(share * 7))]
    assert runs == [r for r in want if r[1] > r[0]]
    if share == 1.0:  # everything between the head and the question, in three runs
        assert sum(e - s for s, e in runs) == prompt.question_start - prompt.head_len


def test_a_document_that_was_not_placed_is_recomputed_whole():
    prompt = build_prompt(FakeAdapter(), MESSAGES, [rec("a" * 50), rec("b" * 30)])
    (_, o1), (_, o2) = prompt.pieces
    assert recompute_runs(prompt, [True, False], 0.1) == [(o1, o1 + 5), (o1 + 50, o2 + 30)]


def test_long_texts_are_embedded_in_overlapping_windows():
    words = [f"w{i}" for i in range(400)]
    windows = text_windows(" ".join(words), words=150, overlap=30)
    assert [w.split()[0] for w in windows] == ["w0", "w120", "w240", "w360"]
    assert all(len(w.split()) <= 150 for w in windows) and windows[-1].split()[-1] == "w399"
    assert text_windows("short text") == ["short text"]
