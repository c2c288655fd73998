"""Prefix-aware routing: which worker of a :class:`~.pool.WorkerPool` gets a job.

Each worker's engine keeps the last conversation it answered live (its idle-time job extends it
with the answer, ``request/idle.py``): a job whose prompt begins with that conversation injects
nothing there and prefills only its new part. The pool does not tokenize, so it compares text: a
job's prompt as :func:`prompt_text` (chat messages as ``role NUL content`` joined by ``SOH``; a
string prompt as is, each behind a marker of its kind so the two never match), a worker's live
context as :func:`context_text` (its last answered prompt followed by the answer). The score of
a worker is :func:`prefix_score`: the characters the two have in common at the start, 0 under
:data:`MIN_PREFIX_CHARS` (a role name or a few words are shared by unrelated prompts and give
the engine nothing it can continue: it needs 64 live tokens).

:func:`choose_worker` applies the rules to the scores and the outstanding jobs.
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
    """The canonical text of a job's prompt (a string, or chat messages with ``role`` and
    ``content``)."""
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
    """The common prefix of a job's :func:`prompt_text` and a worker's :func:`context_text`
    (None: nothing live), in characters of the prompt (the kind's marker not counted); 0 under
    ``least``."""
    if not context:
        return 0
    common = common_prefix_chars(job_text, context) - _MARK
    return common if common >= least else 0


def choose_worker(loads: Sequence[int], scores: Sequence[int],
                  last_used: Sequence[int] | None = None,
                  unstarted: Sequence[int] | None = None) -> tuple[int, bool]:
    """The worker for a job, and whether its prefix placed it.

    ``loads[i]``: worker i's outstanding jobs; ``scores[i]``: its :func:`prefix_score`;
    ``last_used[i]``: when it was last given a job (a counter; default: all 0);
    ``unstarted[i]``: characters of the prompts of its jobs that have sent nothing yet (queued,
    or in their prefill; default: all 0).

    * No score above 0: the worker with the fewest outstanding jobs; on a tie the one with the
      fewest unstarted prompt characters (a job that is decoding ends sooner than one that has
      its prefill and its decoding ahead), then the one given a job longest ago (then the lowest
      index), so that conversations begun one after the other each keep a worker whose live
      sequence holds them.
    * Else the best score (ties: fewer outstanding jobs, then the lowest index), unless that
      worker is busy (has outstanding jobs) while another is idle: then the idle worker with the
      best score (ties: the lowest index). Waiting behind another job costs more than
      prefilling a conversation again (most of it comes from the store anyway). When every
      worker is busy, only those with at most one job more than the least loaded compete, so
      that prompts sharing a system prompt do not pile up on one worker.

    Returns (index, by_prefix): by_prefix is True when the chosen worker's score is above 0
    and there was a choice (more than one worker).
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
