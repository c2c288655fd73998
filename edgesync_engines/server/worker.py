"""One engine in one process: the loop a worker of :class:`~.pool.WorkerPool` runs.

llama.cpp contexts are not thread-safe, so each worker process owns one :class:`EdgeSync` (one
engine) and answers its queue's requests one at a time, in arrival order. Workers share the
store directory, which is safe across processes. Only plain dicts cross the process boundary
(see :mod:`.pool` for their fields); nothing read from the network is unpickled here: the
server parses and checks the JSON and passes the values on.

A request stops early when the server marks its id on the worker's :class:`CancelBoard` (the
client went away, or the shutdown grace ran out): checked after every token, and before a queued
job starts (it is then answered ``cancelled`` at once). A stream's next token is computed once
the server marks its first piece sent there. After a chat answer the engine's idle-time job
(``EdgeSync.idle``) runs on this loop's thread while no job waits, a batch at a time; a job that
arrives stops the batch running midway (``EngineAdapter.abortable``). The worker reports the
job's counters with each ``done`` and, when they changed, between jobs (an ``idle`` message).
Once its idle-time work is done, it makes room to inject the longest conversation the pool said
another worker holds (a ``room`` message, see :mod:`.pool`). A ``prepare`` message queues the
idle-time job of a conversation another worker was storing when a new one took its place
(``EdgeSync.prepare_later``).
With several workers, each evaluation takes its share of the CPUs (:mod:`.core_share`): a
request's prefill runs alone on every thread, and idle-time work also stops for another
worker's prefill. Ctrl-C, and a service manager's SIGTERM, reach the whole process group:
workers ignore both (from their start: :func:`stop_signals_blocked`), so that the server first
lets in-flight requests finish and then stops them (a None in the queue: the worker finishes its
queued idle-time work first, unless the server asks it to skip that,
:meth:`CancelBoard.skip_drain`). A worker whose server is gone stops by itself at any stage
(:mod:`.parent_watch`): while it starts, at once; once serving, after the job it runs, during
the batch of idle-time work it is running.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import time
from contextlib import contextmanager, nullcontext

from edgesync_engines.adapters.protocol import ContextOverflowError
from edgesync_engines.server.core_share import PREFILL_TURN_TOKENS, CoreShare
from edgesync_engines.server.parent_watch import ParentWatch

log = logging.getLogger(__name__)

RESULT_FIELDS = ("hit", "prompt_tokens", "tokens_reused", "tokens_prefilled", "ttft_ms", "total_ms",
                 "approximate", "convertible", "similarity", "uncached_reason", "live_tokens", "idle_wait_ms")
"""The :class:`GenerationResult` fields a ``done`` message carries (``completion_tokens`` and
``idle`` too)."""
STOP_DRAIN_S = 20.0
"""At a stop, seconds a worker may spend finishing queued idle-time work (the pool waits 30 s
for its workers to close, :meth:`~.pool.WorkerPool.close`)."""
CANCELS_KEPT = 256
"""Cancelled job ids a :class:`CancelBoard` holds (the newest): more than a worker's queue holds
in practice; an older one overwritten only lets that job run to its end unread."""
FIRST_PIECE_WAIT_S = 0.02
"""Seconds a worker waits, at most, for the server to send a stream's first piece before it
computes the next token (:func:`serve_one`)."""
FIRST_PIECE_POLL_S = 0.0002
"""Seconds between its checks: a sleep, so that the server's process has the core meanwhile."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals a worker ignores: Ctrl-C and a service manager's stop reach the whole process
group, and the server stops its workers itself."""
IDLE_FIELDS = ("jobs", "interrupted", "tokens_prefilled", "tokens_wasted", "fragments_written", "failed")
"""The ``IdleStats`` counters a worker reports (``done``'s ``result["idle"]``, ``idle``'s ``stats``)."""


class CancelBoard:
    """What a server tells one worker process about its jobs while they run, in shared memory:
    the jobs it cancelled (the newest :data:`CANCELS_KEPT` job ids, in a ring), the last job
    whose first piece it sent to its client (:meth:`first_piece_sent`), and its request to skip
    the stop's idle-time work.

    Args:
        ctx: the ``multiprocessing`` context the worker is started with.
    """

    def __init__(self, ctx) -> None:
        self._ids = ctx.Array("q", CANCELS_KEPT, lock=False)  # job ids are positive; 0: empty
        self._written = ctx.Value("q", 0, lock=False)
        self._skip_drain = ctx.Value("b", 0, lock=False)
        self._first_sent = ctx.Value("q", 0, lock=False)

    def first_piece_sent(self, job_id: int) -> None:
        """Mark that the server wrote ``job_id``'s first streamed piece to its client."""
        self._first_sent.value = job_id

    def wait_first_piece(self, job_id: int, timeout_s: float = FIRST_PIECE_WAIT_S) -> bool:
        """Wait until the server marks ``job_id``'s first piece sent (True), its job is
        cancelled, or ``timeout_s`` seconds pass (False), checking every
        :data:`FIRST_PIECE_POLL_S`."""
        deadline = time.perf_counter() + timeout_s
        while self._first_sent.value != job_id:
            if time.perf_counter() >= deadline or self.cancelled(job_id):
                return False
            time.sleep(FIRST_PIECE_POLL_S)
        return True

    def cancel(self, job_id: int) -> None:
        """Mark ``job_id`` cancelled (the server calls it from one thread at a time)."""
        n = self._written.value
        self._ids[n % CANCELS_KEPT] = job_id
        self._written.value = n + 1

    def cancelled(self, job_id: int) -> bool:
        return job_id in self._ids[:]

    def skip_drain(self) -> None:
        """Ask the worker to leave its queued idle-time work at a stop (a second Ctrl-C)."""
        self._skip_drain.value = 1

    @property
    def drain_skipped(self) -> bool:
        return bool(self._skip_drain.value)


def idle_counters(engine) -> dict[str, int]:
    """The engine's cumulative idle-time counters (zeros for an engine without idle-time work)."""
    stats = getattr(getattr(engine, "idle", None), "stats", None)
    if stats is None:
        return dict.fromkeys(IDLE_FIELDS, 0)
    values = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else {}
    return {name: int(values.get(name, 0)) for name in IDLE_FIELDS}


def worker_main(index: int, settings: dict, requests, responses, cancel: CancelBoard, log_level: str = "WARNING",
                cores: CoreShare | None = None) -> None:
    """Process entry point: load the engine of ``settings`` (``EdgeSyncConfig.to_dict()``
    values), say ``ready`` (or ``fatal`` with the reason), then serve ``requests`` until a None
    arrives or the server process is gone. At a None, finish the idle-time work already queued
    (for up to :data:`STOP_DRAIN_S`, so that the conversations just answered are stored for the
    next start); close the engine and the store on the way out. ``cores``: the CPU threads this
    worker shares with the pool's others (None: its engine's own threads are all it uses). A
    server that is gone ends the worker at any stage (:mod:`.parent_watch`)."""
    # first: the engine's imports and load take seconds, and a server stopped meanwhile must
    # not leave this process behind
    watch = ParentWatch(f"worker {index}").start()
    ignore_stop_signals()
    logging.basicConfig(level=getattr(logging, log_level, logging.WARNING),
                        format=f"%(asctime)s %(levelname)s worker-{index} %(name)s: %(message)s")
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.router import EdgeSync

    try:
        config = EdgeSyncConfig.load(settings)
        engine = EdgeSync(config=config)
    except Exception as exc:  # any load failure is reported to the server, which exits with it
        responses.put({"type": "fatal", "worker": index, "message": f"{type(exc).__name__}: {exc}"})
        return
    try:
        share_engine(engine, requests, cores, watch, index)
        watch.serving()  # before ready: the pool's thread that started this process waits for it
        responses.put({"type": "ready", "worker": index, "pid": os.getpid()})
        serve_jobs(engine, config, index, requests, responses, cancel, cores, watch)
    finally:
        engine.close()
        log.info("worker %d: engine and store closed", index)


@contextmanager
def stop_signals_blocked():
    """Block :data:`STOP_SIGNALS` in the calling thread for the ``with`` block: a worker process
    started in it starts with them blocked (the mask is kept through fork and exec), so that a
    Ctrl-C reaching the process group while it starts up (the interpreter, the unpickling of
    its arguments) cannot end it with a traceback before :func:`ignore_stop_signals`. A signal
    sent to the server meanwhile is delivered at the block's end. Nothing where the platform has
    no ``pthread_sigmask``."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals() -> None:
    """Ignore :data:`STOP_SIGNALS` (the server stops its workers itself), then unblock them
    (:func:`stop_signals_blocked`: a Ctrl-C pending since the start is then discarded)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def share_engine(engine, requests, cores: CoreShare | None, watch: ParentWatch, index: int) -> None:
    """Set ``engine`` up for the worker's loop: idle-time work runs on the loop's thread between
    requests (IdleRunner's ``threaded`` off: one thread evaluates), stopped even midway through a
    batch by a request waiting in this worker's queue or a server that is gone; with ``cores``,
    each evaluation takes this worker's share of the CPU threads."""
    engine.idle.threaded = False
    engine.idle.busy = lambda: not requests.empty() or watch.gone
    if cores is not None:
        cores.attach(index, engine.adapter.set_threads)
        engine.adapter.batch_turn = cores.batch
        # cut prefill batches are bit-identical only without flash attention (docs/benchmarks.md)
        if not getattr(engine.adapter, "flash_attn", False):
            engine.adapter.turn_tokens = PREFILL_TURN_TOKENS
        # nor goes on with threads that are no longer its share, nor delays another's prefill
        engine.idle.busy = lambda: not requests.empty() or cores.should_yield() or watch.gone


def serve_jobs(engine, config, index: int, requests, responses, cancel: CancelBoard, cores: CoreShare | None,
               watch: ParentWatch) -> None:
    """The worker's loop (see :func:`worker_main`): until a None arrives or the server is gone,
    run idle-time work while no job waits, and answer each job of ``requests`` in turn."""
    reported = idle_counters(engine)
    room_wanted = 0  # tokens of the longest conversation another worker holds (the pool's hint)
    while not watch.gone:  # a server killed without closing the pool: stop too
        idle_done = run_idle(engine, cores)
        if idle_done and room_wanted:
            room_wanted = make_room(engine, cores, room_wanted)
        now = idle_counters(engine)
        if now != reported:
            responses.put({"type": "idle", "worker": index, "stats": now, "pending": engine.idle.has_work})
            reported = now
        try:  # idle-time work paused for another worker's prefill goes on soon after
            job = requests.get(timeout=0.5 if idle_done else 0.01)
        except queue.Empty:
            continue
        if job is None:
            drain(engine, cancel, watch, index)
            return
        if job.get("type") == "room":
            room_wanted = max(room_wanted, int(job["tokens"]))
            continue
        if job.get("type") == "prepare":
            try:
                engine.prepare_later(job["prompt"])
            except ValueError as exc:  # the pool sends answered conversations: not expected
                log.warning("worker %d: a conversation handed over was refused: %s", index, exc)
            continue
        if cancel.cancelled(job["id"]):  # its client is gone, or the server stopped waiting for it
            responses.put({"id": job["id"], "type": "cancelled"})
            continue
        final = serve_one(engine, config, job, cancel, responses.put, cores)
        if final["type"] == "done":
            reported = final["result"]["idle"]
            idle_wait_s = engine.idle.work_ended_at - job.get("submitted_at", engine.idle.work_ended_at)
            if idle_wait_s > 0:  # idle-time work ended after the request came: it waited in the queue
                final["result"]["idle_wait_ms"] = idle_wait_s * 1000
        responses.put(final)
    log.info("worker %d: the server process %d is gone; closing the engine", index, watch.parent_pid)


def run_idle(engine, cores: CoreShare | None) -> bool:
    """Run the engine's queued idle-time work while nothing needs the engine, as one step of
    ``cores`` when given; True when none is left."""
    if cores is None or not engine.idle.has_work:
        return engine.idle.run_pending()
    with cores.active(), cores.step():
        return engine.idle.run_pending()


def make_room(engine, cores: CoreShare | None, n_tokens: int) -> int:
    """Idle time, once the idle-time work is done: room for injecting a conversation of
    ``n_tokens`` tokens (``EdgeSync.make_room``), as one step of ``cores`` when given, given
    up when a request arrives. Returns the tokens still wanted (0: the room is there)."""
    t0 = time.perf_counter()
    with cores.active() if cores is not None else nullcontext(), cores.step() if cores is not None else nullcontext():
        made = engine.make_room(n_tokens, engine.idle.busy)
    log.debug("room for injecting %d tokens %s in %.1f ms", n_tokens, "made" if made else "given up for a request",
              (time.perf_counter() - t0) * 1000)
    return 0 if made else n_tokens


def drain(engine, cancel: CancelBoard, watch: ParentWatch, index: int) -> bool:
    """Run the engine's queued idle-time work for at most :data:`STOP_DRAIN_S`; stop (midway
    through the batch where the engine can) when the server asks to skip it
    (:meth:`CancelBoard.skip_drain`) or is gone, or the time is up. True
    when the work is done."""
    deadline = time.monotonic() + STOP_DRAIN_S

    def stop_reason() -> str | None:
        if cancel.drain_skipped:
            return "skipped"
        if watch.gone:
            return "left: the server is gone"
        return f"not finished in {STOP_DRAIN_S:.0f} s" if time.monotonic() >= deadline else None

    engine.idle.busy = lambda: stop_reason() is not None
    if engine.idle.run_pending():
        return True
    log.warning("worker %d: idle-time work %s; the next turn prefills the rest", index, stop_reason() or "paused")
    return False


def _error(job_id: int, status: int, message: str, err_type: str = "invalid_request_error",
           code: str | None = None, param: str | None = None) -> dict:
    return {"id": job_id, "type": "error", "status": status, "message": message, "err_type": err_type,
            "code": code, "param": param}


def serve_one(engine, config, job: dict, cancel: CancelBoard, emit=None, cores: CoreShare | None = None) -> dict:
    """Answer one request dict (``id``, ``prompt`` (str or chat messages), ``max_tokens``,
    ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``reuse``) on ``engine``;
    returns the final message (``done``, ``error`` or ``cancelled``). Streamed pieces go
    through ``emit`` (default: the worker's response queue, see :func:`worker_main`). With
    ``cores``, the request's prefill (up to its first piece) is a :meth:`CoreShare.prefill` and
    each later piece a :meth:`CoreShare.step`. After a stream's first piece the worker waits
    (:meth:`CancelBoard.wait_first_piece`, at most :data:`FIRST_PIECE_WAIT_S`) until the server
    has sent it, and no other worker computes meanwhile (:meth:`CoreShare.hold`): the workers'
    threads fill the cores, and the server's process would otherwise forward the first token
    (the client's TTFT) while the next one, or another worker's, is computed."""
    job_id = job["id"]
    if job.get("reuse") == "semantic" and not config.semantic:
        return _error(job_id, 400, "edgesync.reuse: 'semantic' needs the semantic lookup, which is off "
                      "on this server (EDGESYNC_SEMANTIC)", param="edgesync.reuse")
    field = "messages" if isinstance(job.get("prompt"), list) else "prompt"
    try:
        with cores.active() if cores is not None else nullcontext():
            return _generate(engine, job, cancel, emit, cores)
    except ContextOverflowError as exc:
        return _error(job_id, 400, str(exc), code="context_length_exceeded", param=field)
    except UnicodeError as exc:  # e.g. a lone surrogate, which has no UTF-8 form to tokenize
        return _error(job_id, 400, f"{field}: the text is not valid Unicode ({exc.reason})", code="invalid_value",
                      param=field)
    except ValueError as exc:  # the engine refused the prompt (empty, ...) or a stop string; it names which first
        param = "stop" if str(exc).startswith("stop") else field
        # the Python API's argument is "prompt" for chat messages too; the body's field is "messages"
        message = str(exc).removeprefix("prompt: ") if param == "messages" else str(exc)
        return _error(job_id, 400, message, code="invalid_value", param=param)
    except Exception as exc:  # the request fails, the worker goes on
        log.exception("request %s failed", job_id)
        return _error(job_id, 500, f"the engine failed: {type(exc).__name__}: {exc}", "server_error")


def _generate(engine, job: dict, cancel: CancelBoard, emit, cores: CoreShare | None) -> dict:
    """The generation loop of :func:`serve_one`: decoding ends at a stop string, an
    end-of-generation token, ``max_tokens``, or at once when the server cancels the job (the
    client went away); the prompt is stored in every case."""
    job_id = job["id"]
    stream = engine.generate(job["prompt"], max_tokens=job["max_tokens"], stream=True,
                             temperature=job["temperature"], top_p=job["top_p"], seed=job["seed"],
                             reuse=job.get("reuse"), stop=job.get("stop") or None)
    text: list[str] = []
    first_token_at = None
    pieces = iter(stream)
    with stream:
        while True:
            first = first_token_at is None
            with _turn(cores, first=first):
                piece = next(pieces, None)
                if first and piece is not None:
                    first_token_at = time.time()
                    _send_first(job, piece, cancel, emit, cores)
            if piece is None:
                break
            if cancel.cancelled(job_id):
                stream.stop()
                return {"id": job_id, "type": "cancelled"}
            text.append(piece)
            if not first and job.get("stream") and emit is not None:
                emit({"id": job_id, "type": "piece", "text": piece})
    result = stream.result
    fields = {name: getattr(result, name) for name in RESULT_FIELDS}
    fields["completion_tokens"] = len(result.tokens)
    fields["idle"] = idle_counters(engine)
    fields["idle_pending"] = engine.idle.has_work
    return {"id": job_id, "type": "done", "text": "".join(text), "finish_reason": result.finish_reason,
            "first_token_at": first_token_at or time.time(), "result": fields}


def _send_first(job: dict, piece: str, cancel: CancelBoard, emit, cores: CoreShare | None) -> None:
    """The first piece of a stream goes to the server, and the worker waits until the server
    has written it (:meth:`CancelBoard.wait_first_piece`) while no worker computes
    (:meth:`CoreShare.hold`): the server's and the client's processes then have the cores
    for it. A request that does not stream says it started (the pool routes by it)."""
    if emit is None:
        return
    if not job.get("stream"):
        emit({"id": job["id"], "type": "started"})
        return
    emit({"id": job["id"], "type": "piece", "text": piece})
    with cores.hold() if cores is not None else nullcontext():
        cancel.wait_first_piece(job["id"])


def _turn(cores: CoreShare | None, first: bool):
    """The share of the CPUs the next piece is computed in (see :func:`serve_one`)."""
    if cores is None:
        return nullcontext()
    return cores.prefill() if first else cores.step()
