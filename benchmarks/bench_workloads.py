"""How the benchmark runner deals its three workloads (``seed``, ``doc-qa``, ``chat``): which
rows of the shared data each takes (a seeded selection), and the chat sessions whose prompts
grow with the model's own answers. The data itself is read and checked by
:mod:`edgesync_bench.workloads` (the workloads ``edgesync run`` serves); this module
only selects and orders.

Data: ``../shared/workloads/`` relative to the project root (``$EDGESYNC_WORKLOADS``
overrides), read through :mod:`edgesync_bench.workloads`; nothing is copied. Every
choice below is a fixed seed, so every run and every process sees the same requests.

``seed``
    :func:`seed_requests`: exactly ``edgesync_bench.workloads.seed_workload(1000)``
    (README "The seed benchmark workload": ``qqp_clusters.jsonl`` all rows shuffled with
    ``random.Random(0)``, first 64 kept; ``system_prompts.json`` all 8 rows; 1,000 draws
    of a fresh ``random.Random(0)``). ``limit=SLOW_SYSTEM_LIMIT`` (300) gives its first 300
    requests, for the slower systems, which run a part of it.
``doc-qa``
    :func:`doc_qa_requests`: 40 passages (rows) of ``doc_qa.jsonl``, chosen as
    ``sorted(random.Random(0).sample(range(n_rows), 40))`` and kept in file order (fewer, ``n``:
    the first ``n`` of that same draw, so a smaller sample is a subset of the 40; the runner's
    full run takes :data:`BENCH_DOC_QA_PASSAGES`); each
    passage's questions in file order as successive requests, with the messages of
    ``edgesync_bench.workloads.doc_qa_workload`` (system ``DOC_QA_SYSTEM_PROMPT``, user
    ``"Passage (title):\\n<context>\\n\\nQuestion: <q>"``). Why a sample and not the first
    40: the file is grouped by article, and its first 40 rows come from 19 SQuAD 1.1 /
    XQuAD articles only (245 questions); the seeded sample spans the whole file, the SQuAD
    2.0 articles with up to 15 questions a passage included (207 questions), which gives
    the prefetch predictor longer chains. ``seed=None`` takes the first 40 rows instead
    (then the result equals ``doc_qa_workload(40)``, what ``edgesync run doc-qa`` uses).
``chat``
    :func:`chat_sessions`: 40 sessions of ``chat_sessions.jsonl``, chosen as
    ``sorted(random.Random(0).sample(range(n_rows), 40))`` in file order (fewer: the first ``n``
    of that draw, as for doc-QA; the runner's full run takes :data:`BENCH_CHAT_SESSIONS`). Why
    a sample: the file is sorted by ``session_id``, so its first 40 rows are all Chatbot
    Arena; the sample holds 29 WildChat, 6 Chatbot Arena and 5 OpenAssistant sessions (145
    user turns), close to the file's mix (339 / 120 / 41). ``seed=None`` takes the first 40
    rows.

    The prompt of turn ``j`` is the conversation so far: user turns ``0..j`` with the
    model's own answers to turns ``0..j-1`` between them. Those answers exist only at run
    time, so a session is a :class:`ChatSession` object: :meth:`ChatSession.next_prompt`
    gives the next :class:`ChatTurn` (or ``None`` when the session is over) and
    :meth:`ChatSession.record_answer` takes the model's answer text back.

    Context cut-off: a turn whose rendered prompt (``count_tokens(messages)`` tokens,
    counted by the caller with the model's own chat template and tokenizer, see
    :func:`adapter_token_counter`) plus ``max_tokens`` (16) new tokens exceeds ``n_ctx``
    (4,096) ends its session: it and every later turn (whose prompts would only be longer)
    are not served, and are counted in :attr:`ChatSession.cut_turns`. A few sessions hold a
    pasted turn over 20,000 characters (README of the data); such a session may end at its
    first turn with no turn served.

Every request and turn carries a stable ``prompt_key`` (so a repeat can be told from a
first-seen prompt) and a ``group`` (the seed workload's ``"topic-T"`` system-prompt cluster, the
passage's ``doc_id``, or the chat ``session_id``). For seed and doc-QA equal keys mean equal
messages. A chat key names the turn (``"<session_id>#t<turn>"``); its messages also hold the
model's earlier answers, so two runs give equal messages under one key only when their
answers agree (greedy decoding on the same model: yes; an approximate reuse mode that changes
an answer: no; compare ``messages`` where that matters). Chat keys never match across
sessions, even where two sessions open with the same text.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from edgesync_bench.workloads import (
    DOC_QA_FILE,
    Request,
    WorkloadDataError,
    data_file,
    doc_qa_workload,
    read_jsonl,
    seed_workload,
)

__all__ = [
    "BENCH_CHAT_SESSIONS",
    "BENCH_DOC_QA_PASSAGES",
    "BENCH_MAX_TOKENS",
    "BENCH_N_CTX",
    "CHAT_FILE",
    "ChatSession",
    "ChatTurn",
    "N_CHAT_SESSIONS",
    "N_DOC_QA_PASSAGES",
    "SELECTION_SEED",
    "SLOW_SYSTEM_LIMIT",
    "adapter_token_counter",
    "chat_sessions",
    "doc_qa_requests",
    "seed_requests",
]

log = logging.getLogger(__name__)

#: New tokens per request.
BENCH_MAX_TOKENS = 16
#: Context window in tokens that a chat turn's prompt plus ``BENCH_MAX_TOKENS`` must fit.
BENCH_N_CTX = 4096
#: Seed-workload requests run by no cache and the peers (naive string, LlamaRAMCache,
#: LlamaDiskCache): the first 300 of the 1,000 that EdgeSync runs.
SLOW_SYSTEM_LIMIT = 300
#: Passages of ``doc_qa.jsonl`` drawn for the doc-QA workload (a smaller sample is a prefix of the draw).
N_DOC_QA_PASSAGES = 40
#: Sessions of ``chat_sessions.jsonl`` drawn for the chat workload (likewise).
N_CHAT_SESSIONS = 40
#: Passages the runner's full run takes (the first 10 of the 40 drawn; 48 questions): about 5
#: minutes of the hour on 2 cores, from the 40-passage run's 19.5 minutes for 207 questions.
BENCH_DOC_QA_PASSAGES = 10
#: Sessions the runner's full run takes (the first 10 of the 40 drawn; 29 user turns, about 5
#: minutes, from the 40-session run's 17.7 minutes for 145 turns, by turns and prompt tokens).
BENCH_CHAT_SESSIONS = 10
#: Seed of ``random.Random`` that picks the doc-QA passages and the chat sessions.
SELECTION_SEED = 0
CHAT_FILE = "chat_sessions.jsonl"

#: Counts the prompt tokens of chat messages (rendered with the chat template) -> int.
TokenCounter = Callable[[Sequence[dict]], int]


def seed_requests(
    limit: int | None = None, data_dir: str | os.PathLike | None = None
) -> list[Request]:
    """The seed workload: ``seed_workload(1000)`` of :mod:`edgesync_bench.workloads`.

    ``limit=None`` gives all 1,000 requests; ``limit=n`` (1..1000) the first ``n``, e.g.
    :data:`SLOW_SYSTEM_LIMIT` for the slower systems. Fields as in ``seed_workload``:
    ``group`` ``"topic-T"``, ``prompt_key`` ``"pPvV"``.

    Raises:
        ValueError: ``limit`` outside 1..1000.
        WorkloadDataError: data missing or malformed.
    """
    if limit is not None and not 1 <= limit <= 1000:
        raise ValueError(f"limit must be in 1..1000 or None, got {limit}")
    return seed_workload(1000 if limit is None else limit, data_dir=data_dir)


def _read_rows(name: str, data_dir: str | os.PathLike | None) -> list[dict]:
    """The JSON objects of a ``.jsonl`` data file, in file order (``data_file`` and
    ``read_jsonl``'s errors)."""
    return read_jsonl(data_file(name, data_dir))


def _pick(n_rows: int, n: int, seed: int | None, what: str, draw: int) -> list[int]:
    """Row indices, ascending: the first ``n`` of ``random.Random(seed).sample(range(n_rows),
    max(n, draw))`` (so every ``n <= draw`` picks a subset of the same ``draw`` rows; for
    ``n == draw`` this is ``sample(range(n_rows), n)`` itself), or the first ``n`` rows."""
    if n < 1:
        raise ValueError(f"{what}: n must be >= 1, got {n}")
    if n > n_rows:
        raise WorkloadDataError(f"{what}: needs {n} rows, the file has {n_rows}")
    if seed is None:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n_rows), min(max(n, draw), n_rows))[:n])


def doc_qa_requests(
    n_passages: int = N_DOC_QA_PASSAGES,
    seed: int | None = SELECTION_SEED,
    data_dir: str | os.PathLike | None = None,
) -> list[Request]:
    """The doc-QA workload: ``n_passages`` passages, all their questions in file order.

    Passages: the first ``n_passages`` of ``random.Random(seed).sample(range(n_rows), 40)``
    (more than 40: a sample of ``n_passages``), sorted, of ``doc_qa.jsonl`` (``seed=None``: the
    first ``n_passages`` rows). Requests come from
    ``doc_qa_workload`` (same messages, ``group`` = ``doc_id``, ``prompt_key`` =
    ``"<doc_id>#q<j>"``), renumbered ``request_id`` ``"doc-qa-NNNN"`` by position here.

    Raises:
        ValueError: ``n_passages < 1``.
        WorkloadDataError: data missing or malformed, or fewer rows than ``n_passages``.
    """
    rows = _read_rows(DOC_QA_FILE, data_dir)
    chosen = _pick(len(rows), n_passages, seed, DOC_QA_FILE, N_DOC_QA_PASSAGES)
    ids = [rows[i].get("doc_id") for i in chosen]
    wanted = set(ids)
    full = doc_qa_workload(n_docs=len(rows), data_dir=data_dir)
    if len(wanted) != len(ids):
        raise WorkloadDataError(f"{DOC_QA_FILE}: duplicate doc_id among the chosen rows")
    picked = [r for r in full if r.group in wanted]
    return [replace(r, request_id=f"doc-qa-{i:04d}") for i, r in enumerate(picked)]


@dataclass(frozen=True)
class ChatTurn(Request):
    """One turn of a chat session, a :class:`Request` with three more fields.

    Fields (besides ``request_id``, ``messages``, ``group``, ``prompt_key``):
        request_id: ``"chat-SS-tJJ"`` (session position SS in the workload, turn JJ, 0-based).
        messages: the conversation so far: ``system`` (if the session has a system
            prompt), then user / assistant alternating, ending with user turn ``turn``.
        group: the session's ``session_id``.
        prompt_key: ``"<session_id>#t<turn>"``: names the turn; the same prompt across
            runs only while the earlier answers agree (greedy decoding on one model).
        turn: 0-based user-turn index within the session.
        max_tokens: new tokens to generate (16).
        prompt_tokens: the prompt's token count as measured by the session's counter.
    """

    turn: int = 0
    max_tokens: int = BENCH_MAX_TOKENS
    prompt_tokens: int = 0


class ChatSession:
    """One multi-turn chat whose prompts include the model's own earlier answers.

    Use::

        while (t := session.next_prompt()) is not None:
            text = model(t.as_messages(), max_tokens=t.max_tokens)
            session.record_answer(text)

    Args:
        session_id: the row's ``session_id`` (the ``group`` of every turn).
        user_turns: the row's user turns, in order.
        count_tokens: ``messages -> prompt tokens`` with the model's chat template and
            tokenizer (:func:`adapter_token_counter`); tests may pass a stand-in.
        index: the session's position in the workload (for ``request_id``).
        max_tokens: new tokens per turn (default 16).
        n_ctx: context window in tokens (default 4,096).
        system_prompt: optional system message put first in every prompt (default none:
            the conversation as the user had it).

    Counters: ``served_turns`` (prompts handed out), ``cut_turns`` (turns not served
    because the context would overflow), ``overflowed`` (the session was cut).

    Raises (from the methods): ``RuntimeError`` when ``next_prompt`` is called while an
    answer is pending or ``record_answer`` without a pending prompt; ``TypeError`` when the
    answer is not a ``str``.
    """

    def __init__(
        self,
        session_id: str,
        user_turns: Sequence[str],
        count_tokens: TokenCounter,
        index: int = 0,
        max_tokens: int = BENCH_MAX_TOKENS,
        n_ctx: int = BENCH_N_CTX,
        system_prompt: str | None = None,
    ) -> None:
        if not user_turns:
            raise ValueError(f"session {session_id!r} has no user turns")
        self.session_id = session_id
        self.user_turns = tuple(user_turns)
        self.index = index
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx
        self._count = count_tokens
        self._history: list[dict] = (
            [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        )
        self._next = 0
        self._pending: ChatTurn | None = None
        self.answers: list[str] = []
        self.served_turns = 0
        self.cut_turns = 0
        self.overflowed = False

    @property
    def n_turns(self) -> int:
        """User turns in the session's data row."""
        return len(self.user_turns)

    @property
    def done(self) -> bool:
        """True once every turn was served and answered, or the session was cut."""
        return self._pending is None and (self.overflowed or self._next >= self.n_turns)

    def next_prompt(self) -> ChatTurn | None:
        """The next turn's prompt, or ``None`` when the session is over (or was just cut).

        Raises:
            RuntimeError: the previous prompt has not been answered yet.
        """
        if self._pending is not None:
            raise RuntimeError(
                f"session {self.session_id!r}: turn {self._pending.turn} is still waiting "
                "for record_answer()"
            )
        if self.done:
            return None
        j = self._next
        messages = tuple(self._history) + ({"role": "user", "content": self.user_turns[j]},)
        n_tokens = int(self._count([dict(m) for m in messages]))
        if n_tokens + self.max_tokens > self.n_ctx:
            self.overflowed = True
            self.cut_turns = self.n_turns - j
            log.info(
                "chat session %s cut at turn %d: %d prompt + %d new tokens > n_ctx %d "
                "(%d turns not served)",
                self.session_id, j, n_tokens, self.max_tokens, self.n_ctx, self.cut_turns,
            )
            return None
        self._pending = ChatTurn(
            request_id=f"chat-{self.index:02d}-t{j:02d}",
            messages=tuple(dict(m) for m in messages),
            group=self.session_id,
            prompt_key=f"{self.session_id}#t{j}",
            turn=j,
            max_tokens=self.max_tokens,
            prompt_tokens=n_tokens,
        )
        self.served_turns += 1
        return self._pending

    def record_answer(self, text: str) -> None:
        """Append the model's answer to the pending turn; later prompts include it.

        Raises:
            RuntimeError: no prompt is pending.
            TypeError: ``text`` is not a ``str``.
        """
        if self._pending is None:
            raise RuntimeError(f"session {self.session_id!r}: no prompt is waiting for an answer")
        if not isinstance(text, str):
            raise TypeError(f"answer must be a str, got {type(text).__name__}")
        self._history.append({"role": "user", "content": self.user_turns[self._pending.turn]})
        self._history.append({"role": "assistant", "content": text})
        self.answers.append(text)
        self._pending = None
        self._next += 1


def chat_sessions(
    count_tokens: TokenCounter,
    n_sessions: int = N_CHAT_SESSIONS,
    seed: int | None = SELECTION_SEED,
    max_tokens: int = BENCH_MAX_TOKENS,
    n_ctx: int = BENCH_N_CTX,
    system_prompt: str | None = None,
    data_dir: str | os.PathLike | None = None,
) -> list[ChatSession]:
    """Fresh :class:`ChatSession` objects for the chat workload, in file order.

    Sessions: the first ``n_sessions`` of ``random.Random(seed).sample(range(n_rows), 40)``
    (more than 40: a sample of ``n_sessions``), sorted, of ``chat_sessions.jsonl``
    (``seed=None``: the first ``n_sessions`` rows). Each call
    builds new sessions with no answers recorded (one per worker process or pass).

    Args: see :class:`ChatSession`; ``count_tokens`` is required because the cut-off is
    measured in the model's own tokens.

    Raises:
        ValueError: ``n_sessions < 1``.
        WorkloadDataError: data missing or malformed, or fewer rows than ``n_sessions``.
    """
    rows = _read_rows(CHAT_FILE, data_dir)
    sessions = []
    for pos, i in enumerate(_pick(len(rows), n_sessions, seed, CHAT_FILE, N_CHAT_SESSIONS)):
        sid, turns = rows[i].get("session_id"), rows[i].get("turns")
        if not isinstance(sid, str) or not (
            isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)
        ):
            raise WorkloadDataError(
                f"{CHAT_FILE}: row {i + 1}: needs a str 'session_id' and a non-empty list of "
                "str 'turns'"
            )
        sessions.append(
            ChatSession(sid, turns, count_tokens, index=pos, max_tokens=max_tokens,
                        n_ctx=n_ctx, system_prompt=system_prompt)
        )
    return sessions


def adapter_token_counter(adapter) -> TokenCounter:
    """A ``count_tokens`` for :class:`ChatSession` from a model adapter.

    ``adapter`` is any object with ``apply_chat_template(messages) -> str`` and
    ``tokenize(text) -> list[int]`` (e.g. ``edgesync_engines.adapters.llamacpp.LlamaCppAdapter``);
    the count is ``len(tokenize(apply_chat_template(messages)))``, the prompt the model
    prefills, generation prompt included.
    """
    def count(messages: Sequence[dict]) -> int:
        return len(adapter.tokenize(adapter.apply_chat_template(list(messages))))

    return count
