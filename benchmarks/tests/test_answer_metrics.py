"""SQuAD v1.1 exact match and token F1, and ROUGE-L, on pairs whose scores are known."""

from __future__ import annotations

import pytest

from edgesync_bench.answer_metrics import exact_match, f1_score, normalize_answer, rouge_l


def test_normalize_answer_follows_squad():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert normalize_answer("an Apple, a pear") == "apple pear"


@pytest.mark.parametrize("pred, golds, em, f1", [
    ("Denver Broncos", ["Denver Broncos"], 1.0, 1.0),
    ("the Denver Broncos.", ["Denver Broncos"], 1.0, 1.0),
    ("Broncos", ["Denver Broncos"], 0.0, 2 / 3),                  # P 1, R 1/2
    ("The Denver Broncos won", ["Denver Broncos"], 0.0, 0.8),     # P 2/3, R 1
    ("Carolina Panthers", ["Denver Broncos"], 0.0, 0.0),
    ("Panthers", ["Denver Broncos", "Carolina Panthers"], 0.0, 2 / 3),  # best over golds
    ("four", ["4", "four"], 1.0, 1.0),
    ("anything", [], 0.0, 0.0),
])
def test_exact_match_and_f1(pred, golds, em, f1):
    assert exact_match(pred, golds) == em
    assert f1_score(pred, golds) == pytest.approx(f1)


def test_rouge_l():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("", "") == 1.0
    assert rouge_l("dog", "the cat sat") == 0.0
    # LCS "the cat the mat" = 4 of 6 tokens each way
    assert rouge_l("the cat lay on the mat", "the cat sat in the mat") == pytest.approx(4 / 6)
    # stemming: "running" and "runs" share the stem "run"
    assert rouge_l("running", "runs") == 1.0
