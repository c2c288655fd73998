"""The batched-decode experiment's bookkeeping (``benchmarks/batched_decode.py``), on made-up
logits: pure logic beside the experiment itself, which needs the real model and is run by hand."""

from __future__ import annotations

import numpy as np

from edgesync_bench.batched_decode import Answer, compare


def _answer(rows: list[list[float]]) -> Answer:
    a = Answer(0, [1, 2, 3])
    for row in rows:
        a.take(np.array(row, dtype=np.float32))
    return a


def test_compare_counts_bit_identical_steps_and_the_largest_difference():
    ref = _answer([[0.0, 1.0], [2.0, 0.5], [0.1, 0.2]])
    got = _answer([[0.0, 1.0], [2.0, 0.5 + 1e-6], [0.1, 0.3]])
    c = compare(ref, got)
    assert c["steps"] == 3
    assert c["identical_steps"] == 1  # a difference in the last bits counts as a difference
    assert np.isclose(c["max_abs_diff"], 0.1)
    assert c["same_tokens"] is True  # the argmax never moved


def test_compare_sees_a_changed_token_and_compares_the_shorter_answer_only():
    ref = _answer([[0.0, 1.0], [2.0, 0.5]])
    got = _answer([[1.0, 0.0]])
    c = compare(ref, got)
    assert c["steps"] == 1 and c["identical_steps"] == 0 and c["same_tokens"] is False


def test_a_decode_row_takes_the_next_position():
    a = _answer([[0.0, 1.0]])
    assert a.row() == (1, 3, 0, True)
    a.take(np.array([5.0, 0.0], dtype=np.float32))
    assert a.row() == (0, 4, 0, True)
