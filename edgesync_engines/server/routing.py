"""Prefix-aware routing: which worker of a :class:`~.pool.WorkerPool` gets a job.

A worker keeps its last conversation live, so a job whose prompt begins with it prefills only
its new part. The pool compares text, not tokens: :func:`prompt_text` of the job against
:func:`context_text` of each worker, scored by :func:`prefix_score` (0 under
:data:`MIN_PREFIX_CHARS`); :func:`choose_worker` applies the rules.
"""

from __future__ import annotations

from typing import Sequence

MIN_PREFIX_CHARS = 128
"""Shortest common prefix, in characters, that counts for routing (about 32 tokens of prose)."""

_CHAT, _TEXT = "chat\x02", "text\x02"
_MARK = len(_CHAT)  # both kinds' markers are this long
_ROLE, _NEXT = "\x00", "\x01"


def _message(m: dict) -> str:
    return f"{m.get('role', '')}{_ROLE}{m.get('content', '')}"


def prompt_text(prompt: "str | Sequence[dict]") -> str:
    """The canonical text of a job's prompt (a string, or chat messages with ``role`` and ``content``)."""
    if isinstance(prompt, str):
        return _TEXT + prompt
    return _CHAT + _NEXT.join(_message(m) for m in prompt)


def context_text(prompt: "str | Sequence[dict]", answer: str) -> str:
    """The canonical text of what a worker holds live after answering ``prompt`` with
    ``answer``: the messages and the assistant's answer, or the prompt string and the answer."""
    if isinstance(prompt, str):
        return _TEXT + prompt + answer
    return prompt_text([*prompt, {"role": "assistant", "content": answer}])


def common_prefix_chars(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` have in common at the start (slices compared, halving the
    range: linear time at C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def prefix_score(job_text: str, context: str | None, least: int = MIN_PREFIX_CHARS) -> int:
    """Characters a job's :func:`prompt_text` shares at its start with a worker's
    :func:`context_text` (None: nothing live), the kind's marker not counted; 0 under ``least``."""
    if not context:
        return 0
    common = common_prefix_chars(job_text, context) - _MARK
    return common if common >= least else 0


def choose_worker(loads: Sequence[int], scores: Sequence[int],
                  last_used: Sequence[int] | None = None,
                  unstarted: Sequence[int] | None = None) -> tuple[int, bool]:
    """The worker for a job, and whether its prefix placed it. Per worker i: ``loads[i]``
    outstanding jobs, ``scores[i]`` its :func:`prefix_score`, ``last_used[i]`` when it last got a
    job, ``unstarted[i]`` prompt characters of its jobs that sent nothing yet (defaults: 0s).

    * No score above 0: fewest jobs, then fewest unstarted characters, then longest unused.
    * Else the best score (ties: fewer jobs), unless that worker is busy and another idle: then the
      best-scored idle one; when all are busy, only those at most one job above the least loaded.

    Returns (index, by_prefix): by_prefix when the chosen score is above 0 among several workers.
    """
    n = len(loads)
    if n != len(scores) or n == 0:
        raise ValueError(f"choose_worker: {n} loads and {len(scores)} scores")
    workers = range(n)
    used = last_used if last_used is not None else [0] * n
    ahead = unstarted if unstarted is not None else [0] * n
    if n == 1 or max(scores) <= 0:
        return min(workers, key=lambda i: (loads[i], ahead[i], used[i], i)), False
    best = min((i for i in workers if scores[i] > 0), key=lambda i: (-scores[i], loads[i], i))
    if loads[best] > 0:
        least = min(loads)
        near = [i for i in workers if loads[i] <= least + (1 if least else 0)]
        pick = min(near, key=lambda i: (-scores[i], loads[i], i))
        return pick, scores[pick] > 0
    return best, True
