"""Answer quality measures: SQuAD v1.1's exact match and token F1 against gold answers, and
ROUGE-L (``rouge-score``) of one output against another.

:func:`normalize_answer`, :func:`f1_score` and :func:`exact_match` follow the official SQuAD
v1.1 evaluation script (``evaluate-v1.1.py``): lower case, punctuation and the articles a/an/the
removed, whitespace collapsed; the score of a prediction is its best over the gold answers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

from edgesync_store.errors import require_extra

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation of an answer string."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: Sequence[str]) -> float:
    """Best token F1 of ``prediction`` over ``golds`` (0.0 with no golds)."""
    return max((_f1(prediction, g) for g in golds), default=0.0)


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


_SCORER = None


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F-measure of ``candidate`` against ``reference`` (``rouge_score``, stemming
    on); 1.0 for two empty texts."""
    global _SCORER
    if not candidate.strip() and not reference.strip():
        return 1.0
    if _SCORER is None:
        rouge_scorer = require_extra("rouge_score.rouge_scorer", "bench", "ROUGE-L")
        _SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return float(_SCORER.score(reference, candidate)["rougeL"].fmeasure)
