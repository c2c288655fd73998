"""The real request workloads that ``edgesync run`` serves (``seed``, ``doc-qa``), built from the
shared data, and the data access (directory lookup, JSON Lines reader) they share with the
benchmark's own dealing of them in ``benchmarks/bench_workloads.py``.

The data is the read-only, shared set described in ``README.md`` of the workloads
directory: ``EDGESYNC_WORKLOADS``, or, only when run from a checkout, ``../shared/workloads/``
beside it. Nothing is copied into the project.

Two workloads are built here, both deterministic (no wall-clock or global randomness):

``seed``
    The seed benchmark, built exactly as the README's "The seed benchmark workload"
    section says, from ``qqp_clusters.jsonl`` (all 1,000 rows, shuffled with
    ``random.Random(0)``, first 64 kept) and ``system_prompts.json`` (all 8 rows), with
    1,000 requests drawn by a fresh ``random.Random(0)``.
``doc-qa``
    Long shared-context questions from ``doc_qa.jsonl``: the first ``n_docs`` rows in
    file order (default 40), every question of each passage in order.

Missing or malformed data raises :class:`WorkloadDataError`; it never skips.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DOC_QA_SYSTEM_PROMPT",
    "ENV_VAR",
    "Request",
    "WORKLOAD_NAMES",
    "WorkloadDataError",
    "data_file",
    "doc_qa_workload",
    "load_workload",
    "read_jsonl",
    "seed_workload",
    "workloads_dir",
    "checkout_workloads_dir",
]

log = logging.getLogger(__name__)

#: Environment variable naming the workloads directory.
ENV_VAR = "EDGESYNC_WORKLOADS"

#: Workload names accepted by :func:`load_workload` ("doc_qa" is also accepted).
WORKLOAD_NAMES = ("seed", "doc-qa")

#: System message of every doc-QA request.
DOC_QA_SYSTEM_PROMPT = "Answer the question using only the passage. Reply briefly."

QQP_CLUSTERS_FILE = "qqp_clusters.jsonl"
SYSTEM_PROMPTS_FILE = "system_prompts.json"
DOC_QA_FILE = "doc_qa.jsonl"

# Seed benchmark constants (README, "The seed benchmark workload").
SEED = 0
SEED_N_PROMPTS = 64
SEED_N_VARIANTS = 4
SEED_PROMPTS_PER_TOPIC = 8
SEED_N_PAIRS = SEED_N_PROMPTS * SEED_N_VARIANTS  # 256
SEED_N_REQUESTS = 1000


class WorkloadDataError(RuntimeError):
    """The workload data is missing or malformed.

    The message names the offending path (and line, for a bad JSON line) and says how
    to point EdgeSync at the data with the ``EDGESYNC_WORKLOADS`` environment variable.
    """


@dataclass(frozen=True)
class Request:
    """One chat request of a workload.

    Fields:
        request_id: position in the workload, e.g. ``"seed-0007"`` or ``"doc-qa-0012"``
            (0-based, zero-padded to 4 digits).
        messages: tuple of chat messages ``{"role": ..., "content": ...}``, system
            message first, then the user message.
        group: what shares a prompt prefix: ``"topic-3"`` (the system prompt of topic 3)
            for the seed workload, the passage's ``doc_id`` for doc-QA.
        prompt_key: identity of the unique prompt: ``"p12v3"`` (prompt 12, variant 3)
            for the seed workload, ``"<doc_id>#q4"`` (0-based question index) for
            doc-QA. Two requests with the same key have identical messages.
    """

    request_id: str
    messages: tuple
    group: str
    prompt_key: str

    def as_messages(self) -> list[dict]:
        """Return the messages as a new list of new dicts (safe to mutate)."""
        return [dict(m) for m in self.messages]


def _hint() -> str:
    return (
        f"set the {ENV_VAR} environment variable to the directory holding the workload "
        f"files (the shared 'workloads' directory with README.md, {QQP_CLUSTERS_FILE}, "
        f"{SYSTEM_PROMPTS_FILE}, {DOC_QA_FILE}), e.g. "
        f"`export {ENV_VAR}=/path/to/shared/workloads`"
    )


def _given_dir(value: str | os.PathLike, source: str) -> Path:
    """``value`` as a directory path (``~`` expanded); WorkloadDataError naming ``source`` (how
    it was given) when it is not a directory."""
    path = Path(value).expanduser()
    if not path.is_dir():
        raise WorkloadDataError(
            f"workloads directory {str(path)!r} ({source}) does not exist or is not a directory; {_hint()}"
        )
    return path


def checkout_workloads_dir() -> Path | None:
    """``../shared/workloads`` beside the checkout this package runs from, or None when it does
    not run from a checkout (installed as a wheel: no ``pyproject.toml`` and ``edgesync_store/``
    beside the ``benchmarks/`` folder)."""
    root = Path(__file__).resolve().parent.parent
    if not ((root / "pyproject.toml").is_file() and (root / "edgesync_store").is_dir()):
        return None
    return root.parent / "shared" / "workloads"


def workloads_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Return the workloads directory.

    Lookup order: ``explicit`` if given; else ``$EDGESYNC_WORKLOADS`` if set and non-empty;
    else, when run from a checkout, ``<checkout>/../shared/workloads``
    (:func:`checkout_workloads_dir`).

    Raises:
        WorkloadDataError: the directory given explicitly or by the environment variable is not
            a directory (no fallback), or neither is given and there is no checkout default;
            one line that says what is missing and how to set :data:`ENV_VAR`.
    """
    if explicit is not None:
        return _given_dir(explicit, "passed explicitly")
    env = os.environ.get(ENV_VAR)
    if env:
        return _given_dir(env, f"from {ENV_VAR}")
    default = checkout_workloads_dir()
    if default is None:
        raise WorkloadDataError(f"no workloads directory: {ENV_VAR} is not set and this is not a checkout; {_hint()}")
    if not default.is_dir():
        raise WorkloadDataError(f"workloads directory not found (tried {str(default)!r}); {_hint()}")
    return default.resolve()


def data_file(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The path of data file ``name`` in the workloads directory; WorkloadDataError when it is
    not a file (the message says how to point ``EDGESYNC_WORKLOADS`` at the data)."""
    path = workloads_dir(data_dir) / name
    if not path.is_file():
        raise WorkloadDataError(f"workload file {str(path)!r} does not exist; {_hint()}")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSON Lines file; a bad line raises WorkloadDataError with its number."""
    rows: list[dict[str, Any]] = []
    try:
        with path.open("r", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise WorkloadDataError(
                        f"{path}: line {lineno}: malformed JSON ({exc.msg}); {_hint()}"
                    ) from exc
                if not isinstance(obj, dict):
                    raise WorkloadDataError(
                        f"{path}: line {lineno}: expected a JSON object, got "
                        f"{type(obj).__name__}; {_hint()}"
                    )
                rows.append(obj)
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadDataError(f"cannot read {str(path)!r}: {exc}; {_hint()}") from exc
    return rows


def _bad(path: Path, lineno: int, what: str) -> WorkloadDataError:
    return WorkloadDataError(f"{path}: line {lineno}: {what}; {_hint()}")


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _load_system_prompts(data_dir: str | os.PathLike | None) -> dict[int, str]:
    """Map topic_id -> system_prompt from ``system_prompts.json`` (all 8 rows)."""
    path = data_file(SYSTEM_PROMPTS_FILE, data_dir)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise WorkloadDataError(
            f"{path}: line {exc.lineno}: malformed JSON ({exc.msg}); {_hint()}"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadDataError(f"cannot read {str(path)!r}: {exc}; {_hint()}") from exc
    if not isinstance(data, list):
        raise WorkloadDataError(f"{path}: expected a JSON list of topics; {_hint()}")
    prompts: dict[int, str] = {}
    for i, item in enumerate(data):
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("topic_id"), int)
            or not isinstance(item.get("system_prompt"), str)
        ):
            raise WorkloadDataError(
                f"{path}: entry {i} lacks an int 'topic_id' and a str 'system_prompt'; "
                f"{_hint()}"
            )
        prompts[item["topic_id"]] = item["system_prompt"]
    return prompts


def _seed_prompts(data_dir: str | os.PathLike | None) -> list[list[str]]:
    """The 64 seed prompts, each a list of its 4 variant questions.

    README steps 1-2: clusters of ``qqp_clusters.jsonl`` in file order, shuffled with
    ``random.Random(0).shuffle``, first 64 kept; each keeps its first 4 questions.
    """
    path = data_file(QQP_CLUSTERS_FILE, data_dir)
    rows = read_jsonl(path)
    for lineno, row in enumerate(rows, start=1):
        if not _str_list(row.get("questions")):
            raise _bad(path, lineno, "'questions' must be a list of strings")
    clusters = list(rows)
    random.Random(SEED).shuffle(clusters)
    kept = clusters[:SEED_N_PROMPTS]
    if len(kept) < SEED_N_PROMPTS:
        raise WorkloadDataError(
            f"{path}: has {len(rows)} clusters, the seed workload needs at least "
            f"{SEED_N_PROMPTS}; {_hint()}"
        )
    prompts = []
    for p, cluster in enumerate(kept):
        questions = cluster["questions"]
        if len(questions) < SEED_N_VARIANTS:
            raise WorkloadDataError(
                f"{path}: cluster {cluster.get('cluster_id')!r} (seed prompt {p}) has "
                f"{len(questions)} questions, needs {SEED_N_VARIANTS}; {_hint()}"
            )
        prompts.append(list(questions[:SEED_N_VARIANTS]))
    return prompts


def seed_workload(
    n_requests: int = SEED_N_REQUESTS, data_dir: str | os.PathLike | None = None
) -> list[Request]:
    """The seed benchmark workload (README, "The seed benchmark workload").

    Data: all rows of ``qqp_clusters.jsonl`` and ``system_prompts.json``.

    1. Clusters in file order, shuffled with ``random.Random(0).shuffle``; first 64 kept.
    2. Prompt ``p`` (0..63) has its cluster's first 4 questions as variants 0..3 and
       belongs to topic ``p // 8``, whose ``system_prompt`` is looked up by ``topic_id``.
    3. A request is ``[system_prompt, question]`` as system and user messages.
    4. Requests are drawn with a fresh ``random.Random(0)``: ``k = rng.randrange(256)``,
       prompt ``k // 4``, variant ``k % 4``.

    The 1,000-draw stream is always the same; ``n_requests < 1000`` returns its first
    ``n_requests`` requests (a prefix), larger values continue the same stream.

    Request fields: ``request_id`` ``"seed-NNNN"`` (draw index), ``group``
    ``"topic-T"``, ``prompt_key`` ``"pPvV"``.
    """
    if n_requests < 1:
        raise ValueError(f"n_requests must be >= 1, got {n_requests}")
    prompts = _seed_prompts(data_dir)
    system_prompts = _load_system_prompts(data_dir)
    n_topics = SEED_N_PROMPTS // SEED_PROMPTS_PER_TOPIC
    missing = [t for t in range(n_topics) if t not in system_prompts]
    if missing:
        path = workloads_dir(data_dir) / SYSTEM_PROMPTS_FILE
        raise WorkloadDataError(f"{path}: no system_prompt for topic_id(s) {missing}; {_hint()}")

    rng = random.Random(SEED)
    requests: list[Request] = []
    for i in range(n_requests):
        k = rng.randrange(SEED_N_PAIRS)
        p, v = divmod(k, SEED_N_VARIANTS)
        topic = p // SEED_PROMPTS_PER_TOPIC
        messages = (
            {"role": "system", "content": system_prompts[topic]},
            {"role": "user", "content": prompts[p][v]},
        )
        requests.append(
            Request(
                request_id=f"seed-{i:04d}",
                messages=messages,
                group=f"topic-{topic}",
                prompt_key=f"p{p}v{v}",
            )
        )
    log.debug("seed workload: %d requests", len(requests))
    return requests


def doc_qa_workload(
    n_docs: int = 40, data_dir: str | os.PathLike | None = None
) -> list[Request]:
    """Document-QA workload: many questions over one long shared passage.

    Data: the first ``n_docs`` rows (passages) of ``doc_qa.jsonl`` in file order (no
    randomness); each passage contributes all its questions, in order, as successive
    requests.

    Messages: system ``DOC_QA_SYSTEM_PROMPT``; user
    ``f"Passage ({title}):\\n{context}\\n\\nQuestion: {question}"``, so every question
    of a passage shares the long passage prefix.

    Request fields: ``request_id`` ``"doc-qa-NNNN"`` (0-based position),
    ``group`` the passage's ``doc_id``, ``prompt_key`` ``"<doc_id>#q<j>"`` (0-based
    question index within the passage).
    """
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    path = data_file(DOC_QA_FILE, data_dir)
    rows = read_jsonl(path)
    if len(rows) < n_docs:
        log.warning("%s has %d passages, fewer than n_docs=%d", path, len(rows), n_docs)
    requests: list[Request] = []
    for lineno, row in enumerate(rows[:n_docs], start=1):
        doc_id, title, context = row.get("doc_id"), row.get("title"), row.get("context")
        questions = row.get("questions")
        if not all(isinstance(x, str) for x in (doc_id, title, context)):
            raise _bad(path, lineno, "'doc_id', 'title' and 'context' must be strings")
        if not _str_list(questions):
            raise _bad(path, lineno, "'questions' must be a list of strings")
        for j, question in enumerate(questions):
            user = f"Passage ({title}):\n{context}\n\nQuestion: {question}"
            requests.append(
                Request(
                    request_id=f"doc-qa-{len(requests):04d}",
                    messages=(
                        {"role": "system", "content": DOC_QA_SYSTEM_PROMPT},
                        {"role": "user", "content": user},
                    ),
                    group=doc_id,
                    prompt_key=f"{doc_id}#q{j}",
                )
            )
    log.debug("doc-qa workload: %d passages, %d requests", min(n_docs, len(rows)), len(requests))
    return requests


def load_workload(
    name: str, limit: int | None = None, data_dir: str | os.PathLike | None = None
) -> list[Request]:
    """Build a workload by name and return its first ``limit`` requests.

    ``name`` is one of :data:`WORKLOAD_NAMES` (``"doc_qa"`` is accepted for
    ``"doc-qa"``); anything else raises ``ValueError``. ``limit=None`` returns the
    whole workload (1,000 seed requests; all questions of the first 40 doc-QA
    passages); ``limit < 1`` raises ``ValueError``. The result is always a prefix of the
    full workload.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if key == "seed":
        n = SEED_N_REQUESTS if limit is None else min(limit, SEED_N_REQUESTS)
        reqs = seed_workload(n, data_dir=data_dir)
    elif key == "doc-qa":
        reqs = doc_qa_workload(data_dir=data_dir)
    else:
        raise ValueError(
            f"unknown workload {name!r}; valid names: {', '.join(WORKLOAD_NAMES)}"
        )
    return reqs if limit is None else reqs[:limit]
