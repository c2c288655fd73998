"""The step loop of a llama.cpp context holding several sequences: one thread that decodes, step
by step, every sequence's next token together and, when a prompt waits, one prefill batch.

Why a step is laid out as it is (``src/llama-batch.cpp``, ``src/llama-kv-cache.cpp`` of the
pinned llama.cpp): with a KV stream per sequence (``kv_unified`` off) llama.cpp cuts a batch into
micro-batches holding an equal number of tokens of consecutive sequence ids
(``llama_batch_allocr::split_equal``, sequential). A prefill batch beside decode rows would be cut
into one row and the rest, which is not how it is computed alone. So a prefill batch is decoded
by itself, its rows grouped as alone, and the decode rows of all sequences then go together in
one ``llama_decode``, sorted by sequence id. Whether a decode row gives the same logits beside
other sequences as alone depends on the kernels (some compute rows by groups of four): the owner
probes how many rows may share a decode (``shared_rows``), and the rows go in decodes of at most
that many (1: each by itself; exact either way, but each decode reads the weights once).

Sampling is llama.cpp's own sampler chain per job, called on the row's logits right after the
decode (``llama_sampler_sample``).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

END = None
"""Put in a job's token queue after its last token."""
MAX_PASSED = 2
"""Prefill batches that may run before a waiting one goes next (a long prompt is slowed at most
threefold, never starved)."""


class Job:
    """One sequence's work: evaluate ``rows`` (token IDs at positions ``pos``, ``pos + 1``, ...)
    as one batch, then, with a ``sampler``, sample a token from the last row's logits and decode
    it, token by token, until ``is_eog`` says so (that token is not put out) or ``max_new`` tokens
    were put out (the last one is not evaluated).

    Args:
        seq: the llama.cpp sequence id.
        sampler: a ``llama_sampler *`` chain (the caller frees it once :attr:`done`), or None.
        keep_logits: keep a copy of the logits each token was sampled from (:attr:`logits`).
        tokens_left: prompt tokens its request still has to evaluate, these rows included (the
            loop runs the prefill with the fewest first).
        background: work that waits while any other prefill does (idle-time storing).

    Attributes:
        tokens: a ``queue.SimpleQueue`` of the sampled tokens (int), then :data:`END`.
        evaluated: positions evaluated so far (rows, then sampled tokens).
        logits: with ``keep_logits``, float32 ``(n_vocab,)`` arrays, one per token sampled.
        done: set once the loop is finished with the job (ended, cancelled or failed).
        error: the exception that failed it (RuntimeError from ``llama_decode``), or None.
    """

    def __init__(self, seq: int, rows: Sequence[int], pos: int, sampler=None, max_new: int = 0,
                 is_eog: Callable[[int], bool] | None = None, keep_logits: bool = False, tokens_left: int = 0,
                 background: bool = False) -> None:
        if not rows:
            raise ValueError("Job: no rows to evaluate")
        self.seq, self.pos = seq, pos
        self.rows = [int(t) for t in rows]
        self.sampler, self.max_new = sampler, max_new
        self.is_eog = is_eog or (lambda token: False)
        self.tokens: queue.SimpleQueue = queue.SimpleQueue()
        self.evaluated = 0
        self.sampled = 0
        self.started = False
        self.cancelled = False
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.logits: list[np.ndarray] | None = [] if keep_logits else None
        self.tokens_left = max(tokens_left, len(self.rows))
        self.background = background
        self.passed = 0

    @property
    def prefilling(self) -> bool:
        """Its rows are a batch of more than one token still to evaluate."""
        return len(self.rows) > 1

    def cancel(self) -> bool:
        """Ask the loop to drop the job before its next step; True when no step had started it."""
        self.cancelled = True
        return not self.started

    def wait(self) -> None:
        """Block until :attr:`done`; raises :attr:`error` if the job failed."""
        self.done.wait()
        if self.error is not None:
            raise self.error


class StepLoop:
    """The thread that runs the :class:`Job` s of one llama.cpp context (see the module).

    Args:
        llama_cpp: the ``llama_cpp`` module.
        ctx: the ``llama_context *``; every other call on it must hold :attr:`ctx_lock`.
        max_rows: rows the loop's ``llama_batch`` holds (``n_batch``: the largest prefill batch,
            and at least the sequence count).
        shared_rows: the most rows one decode ``llama_decode`` may hold (throw-away rows included).
    """

    def __init__(self, llama_cpp, ctx, max_rows: int, shared_rows: int = 1, name: str = "edgesync-steps") -> None:
        self._c, self._ctx = llama_cpp, ctx
        self.ctx_lock = threading.Lock()
        self.shared_rows = shared_rows
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._n_cells = int(llama_cpp.llama_n_ctx_seq(ctx))
        self._batch = llama_cpp.llama_batch_init(max_rows, 0, 1)
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama_cpp.llama_get_model(ctx)))
        self._max_rows = max_rows
        self._cond = threading.Condition()
        self._jobs: list[Job] = []
        self._closed = False
        self.steps = 0
        self.counts: dict[int, list[int]] = {}
        """Per sequence id: [tokens evaluated in batches of several, tokens evaluated alone]."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        """Queue ``job`` (RuntimeError once closed); returns it."""
        if len(job.rows) > self._max_rows:
            raise ValueError(f"Job: {len(job.rows)} rows exceed the batch of {self._max_rows}")
        with self._cond:
            if self._closed:
                raise RuntimeError("the step loop is closed")
            self._jobs.append(job)
            self._cond.notify()
        return job

    def close(self) -> None:
        """Fail the queued jobs, stop the thread and free the batch. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        for job in self._jobs:
            self._end(job, RuntimeError("the engine was closed"))
        self._jobs.clear()
        self._c.llama_batch_free(self._batch)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._jobs:
                    self._cond.wait()
                if self._closed:
                    return
                for job in [j for j in self._jobs if j.cancelled]:
                    self._jobs.remove(job)
                    self._end(job)
                jobs = list(self._jobs)
            if jobs:
                self._step(jobs)

    def _step(self, jobs: list[Job]) -> None:
        """One step: one waiting prefill batch alone (:meth:`_next_prefill`), then every one-row
        job together."""
        prefill = self._next_prefill([j for j in jobs if j.prefilling])
        rows = sorted((j for j in jobs if not j.prefilling), key=lambda j: j.seq)
        with self.ctx_lock:
            if prefill is not None:
                self._decode([prefill], len(prefill.rows))
            for group in self._groups(rows):
                self._decode(group, 1)
        self.steps += 1

    def _decode(self, jobs: list[Job], n_rows: int) -> None:
        """One ``llama_decode`` of ``jobs`` (one prefill job of ``n_rows``, or one-row jobs sorted
        by sequence, with :meth:`_fillers`), then their samples (ctx lock held)."""
        b, i = self._batch, 0
        fillers = self._fillers(jobs) if n_rows == 1 and len(jobs) > 1 else []
        rows = [(job.seq, job.pos + k, token, job) for job in jobs for k, token in enumerate(job.rows)]
        rows += [(seq, pos, jobs[0].rows[0], None) for seq, pos in fillers]
        last: dict[int, int] = {}  # id(job) -> the batch row of its last token
        # in sequence order, fillers included: llama.cpp reads the ids in the batch's order
        for seq, pos, token, job in sorted(rows, key=lambda r: (r[0], r[1])):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = job is not None and pos == job.pos + len(job.rows) - 1 and job.sampler is not None
            if job is not None:
                job.started = True
                last[id(job)] = i
            i += 1
        b.n_tokens = i
        rc = self._c.llama_decode(self._ctx, b)
        for seq, pos in fillers:  # gone again before anything else touches the context
            self._c.llama_memory_seq_rm(self._mem, seq, pos, -1)
        if rc != 0:
            # the failed batch's cells are removed by llama.cpp; the jobs end with the error
            for job in jobs:
                self._drop(job, RuntimeError(f"llama_decode returned {rc}"))
            return
        for job in jobs:
            n = len(job.rows)
            count = self.counts.setdefault(job.seq, [0, 0])
            count[0 if n > 1 else 1] += n
            job.evaluated += n
            job.pos += n
            self._next(job, last[id(job)])

    def _groups(self, rows: list[Job]) -> list[list[Job]]:
        """``rows`` (sorted by sequence) in runs whose sequence ids span at most
        :attr:`shared_rows` (the gaps get throw-away rows: :meth:`_fillers`)."""
        groups: list[list[Job]] = []
        for job in rows:
            if groups and job.seq - groups[-1][0].seq < self.shared_rows:
                groups[-1].append(job)
            else:
                groups.append([job])
        return groups

    @staticmethod
    def _next_prefill(waiting: list[Job]) -> Job | None:
        """Of the prefill batches ``waiting`` (oldest first), the one to run: background work
        last; a batch passed over :data:`MAX_PASSED` times; else the one whose request has the
        fewest prompt tokens left, so a short prompt waits at most one batch behind a long one."""
        if not waiting:
            return None
        pick = min(waiting, key=lambda j: (j.background, j.passed < MAX_PASSED, j.tokens_left))
        for job in waiting:
            if job is not pick and not job.background:
                job.passed += 1
        return pick

    def _fillers(self, jobs: list[Job]) -> list[tuple[int, int]]:
        """(sequence, position) of one throw-away row for each sequence id between the first and
        the last of ``jobs`` that has none: llama.cpp puts rows of consecutive sequence ids in one
        micro-batch, and a gap would split the step in two, reading the weights twice. Each row
        goes right after its sequence's cells (its next position) and is removed after the
        decode; whether neighbours change a row's logits is what the owner probed
        (``shared_rows``)."""
        busy = {job.seq for job in jobs}
        holes = [seq for seq in range(jobs[0].seq, jobs[-1].seq) if seq not in busy]
        fill = [(seq, int(self._c.llama_memory_seq_pos_max(self._mem, seq)) + 1) for seq in holes]
        return [(seq, pos) for seq, pos in fill if pos < self._n_cells]  # a full stream has no cell for it

    def _next(self, job: Job, row: int) -> None:
        """After ``job``'s rows were evaluated: sample from ``row``'s logits and queue the
        token as its next row, or end it."""
        if job.sampler is None or job.cancelled:
            self._drop(job)
            return
        if job.logits is not None:
            logits = self._c.llama_get_logits_ith(self._ctx, row)
            job.logits.append(np.ctypeslib.as_array(logits, shape=(self._n_vocab,)).copy())
        token = int(self._c.llama_sampler_sample(job.sampler, self._ctx, row))
        if job.is_eog(token):
            self._drop(job)
            return
        job.sampled += 1
        job.tokens.put(token)
        if job.sampled >= job.max_new:
            self._drop(job)
            return
        job.rows = [token]

    def _drop(self, job: Job, error: BaseException | None = None) -> None:
        with self._cond:
            if job in self._jobs:
                self._jobs.remove(job)
        self._end(job, error)

    @staticmethod
    def _end(job: Job, error: BaseException | None = None) -> None:
        if job.done.is_set():
            return
        job.error = error
        job.tokens.put(END)
        job.done.set()
