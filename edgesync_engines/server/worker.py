"""One engine in one process: the loop a worker of :class:`~.pool.WorkerPool` runs. Each worker owns
one :class:`EdgeSync` and answers one job at a time (:func:`serve_jobs`), or one per slot on threads
of their own (:func:`serve_slots`); only plain dicts cross the process boundary (fields:
:mod:`.pool`). Workers ignore SIGINT and SIGTERM (the server stops them) and stop by themselves
when their server is gone (:mod:`.parent_watch`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from contextlib import contextmanager, nullcontext

from edgesync_engines.server.core_share import PREFILL_TURN_TOKENS, CoreShare
from edgesync_engines.server.parent_watch import ParentWatch

log = logging.getLogger(__name__)

RESULT_FIELDS = ("hit", "prompt_tokens", "tokens_reused", "tokens_prefilled", "ttft_ms", "total_ms",
                 "approximate", "convertible", "similarity", "uncached_reason", "live_tokens", "idle_wait_ms", "slot")
"""The :class:`GenerationResult` fields a ``done`` message carries."""
STOP_DRAIN_S = 20.0
"""Seconds a stopping worker may spend on queued idle-time work (the pool waits 30 s)."""
CANCELS_KEPT = 256
"""Cancelled job ids a :class:`CancelBoard` keeps (the newest), in a ring."""
FIRST_PIECE_WAIT_S = 0.02
"""Seconds a worker waits at most for the server to send a stream's first piece."""
FIRST_PIECE_POLL_S = 0.0002
"""Seconds between its checks: a sleep, so that the server's process has the core meanwhile."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals a worker ignores (they reach the whole process group; the server stops it)."""
IDLE_FIELDS = ("jobs", "interrupted", "tokens_prefilled", "tokens_wasted", "fragments_written", "failed")
"""The ``IdleStats`` counters a worker reports (``done``'s ``result["idle"]``, ``idle``'s ``stats``)."""
WORKER_MALLOC = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
"""glibc's allocator settings the workers start with (unless set already): two arenas, not one
per thread that ever answered, and blocks of 1 MiB or more (fragments' K and V, seq states)
mapped and returned to the system when freed, instead of held in an arena (see
docs/benchmarks.md, peak memory with slots). Other C libraries ignore them."""


def worker_malloc_settings(environ=None) -> None:
    """Put :data:`WORKER_MALLOC` into ``environ`` (default ``os.environ``, which the workers
    inherit) where not set."""
    environ = os.environ if environ is None else environ
    for name, value in WORKER_MALLOC.items():
        environ.setdefault(name, value)


class CancelBoard:
    """Shared memory from the server to one worker: cancelled job ids (the newest
    :data:`CANCELS_KEPT`), the last job whose first piece was sent, and a request to skip the stop's
    idle-time work. ``ctx``: the worker's ``multiprocessing`` context.
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
        """True once ``job_id``'s first piece is marked sent; False when it is cancelled or
        ``timeout_s`` seconds pass."""
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


def worker_main(index: int, settings: dict | None, requests, responses, cancel: CancelBoard,
                log_level: str = "WARNING", cores: CoreShare | None = None) -> None:
    """Process entry point: load the engine of ``settings`` (``EdgeSyncConfig.to_dict()``),
    say ``ready`` (or ``fatal``), serve ``requests`` until a None (then drain idle-time work for up to
    :data:`STOP_DRAIN_S`) or the server is gone; close engine and store. ``cores``: the CPU threads
    shared with the other workers, or None. ``settings`` None: a worker started before its server
    knew them (:mod:`.early`): it imports the engine, then waits for a ``load`` message with
    ``settings`` and ``log_level`` (a None ends it)."""
    # first: the engine's imports and load take seconds, and a server stopped meanwhile must
    # not leave this process behind
    watch = ParentWatch(f"worker {index}").start()
    ignore_stop_signals()
    began = time.perf_counter()
    from edgesync_engines.config import EdgeSyncConfig
    from edgesync_engines.request.router import EdgeSync

    if settings is None:
        settings, log_level = await_settings(requests, watch)
        if settings is None:
            return
    logging.basicConfig(level=getattr(logging, log_level, logging.WARNING),
                        format=f"%(asctime)s %(levelname)s worker-{index} %(name)s: %(message)s")
    loading = time.perf_counter()
    try:
        config = EdgeSyncConfig.load(settings)
        engine = EdgeSync(config=config)
    except Exception as exc:  # any load failure is reported to the server, which exits with it
        responses.put({"type": "fatal", "worker": index, "message": f"{type(exc).__name__}: {exc}"})
        return
    now = time.perf_counter()
    log.info("worker %d: engine loaded (model, probes, store, warm-up) in %.2f s, %.2f s after its imports began",
             index, now - loading, now - began)
    try:
        share_engine(engine, requests, cores, watch, index)
        watch.serving()  # before ready: the pool's thread that started this process waits for it
        responses.put({"type": "ready", "worker": index, "pid": os.getpid(), "slots": len(engine.lanes)})
        if len(engine.lanes) > 1:
            serve_slots(engine, config, index, requests, responses, cancel, watch)
        else:
            serve_jobs(engine, config, index, requests, responses, cancel, cores, watch)
    finally:
        engine.close()
        log.info("worker %d: engine and store closed", index)


def await_settings(requests, watch: ParentWatch) -> tuple[dict | None, str]:
    """In a worker started early (:mod:`.early`): import llama.cpp's engine modules (the engine
    the settings name most often; they are imported at the load anyway), then wait for the
    ``load`` message. Returns its ``settings`` and ``log_level``, or (None, "") on a None or a
    server gone."""
    import edgesync_engines.adapters.llamacpp_slots  # noqa: F401  (llama_cpp, the adapters)

    while not watch.gone:
        try:
            msg = requests.get(timeout=0.5)
        except queue.Empty:
            continue
        if msg is None:
            return None, ""
        if msg.get("type") == "load":
            return msg["settings"], msg["log_level"]
    return None, ""


@contextmanager
def stop_signals_blocked():
    """Block :data:`STOP_SIGNALS` in the calling thread for the ``with`` block, so a process
    started in it starts with them blocked. Nothing where there is no ``pthread_sigmask``."""
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
    """Set ``engine`` up for the worker's loop: idle-time work on the loop's thread, stopped by a
    queued request or a gone server; with ``cores``, each evaluation takes this worker's share."""
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


def serve_slots(engine, config, index: int, requests, responses, cancel: CancelBoard, watch: ParentWatch) -> None:
    """The loop of a worker whose engine has several slots (``--slots``): until a None arrives or
    the server is gone, start each job of ``requests`` on a thread of its own when a slot is free
    (the queue waits meanwhile; the engine's step loop batches the jobs' evaluations), and run
    idle-time work on the free slots meanwhile. On a None: wait for the jobs running, then
    :func:`drain`."""
    free = threading.Semaphore(len(engine.lanes))
    running: dict[threading.Thread, int] = {}  # the job id each thread answers
    guard = threading.Lock()

    def answer(job: dict) -> None:
        try:
            if cancel.cancelled(job["id"]):  # its client is gone, or the server stopped waiting for it
                responses.put({"id": job["id"], "type": "cancelled"})
                return
            final = serve_one(engine, config, job, cancel, responses.put)
            if final["type"] == "done":
                idle_wait_s = engine.idle.work_ended_at - job.get("submitted_at", engine.idle.work_ended_at)
                if idle_wait_s > 0:  # idle-time work ended after the request came: it waited in the queue
                    final["result"]["idle_wait_ms"] = idle_wait_s * 1000
            responses.put(final)
        finally:
            with guard:
                running.pop(threading.current_thread(), None)
            free.release()

    # idle-time work runs beside the jobs, on a free slot, until a job waits in the queue
    engine.idle.busy = lambda: not requests.empty() or watch.gone
    reported = idle_counters(engine)
    while not watch.gone:
        idle_done = run_idle(engine, None)
        now = idle_counters(engine)
        if now != reported:
            responses.put({"type": "idle", "worker": index, "stats": now, "pending": engine.idle.has_work})
            reported = now
        try:
            job = requests.get(timeout=0.5 if idle_done else 0.01)
        except queue.Empty:
            continue
        if job is None:
            for thread in list(running):
                thread.join()
            drain(engine, cancel, watch, index)
            return
        if job.get("type") == "room":  # a hint for one engine sequence: each slot makes its own room
            continue
        if job.get("type") == "prepare":
            try:
                engine.prepare_later(job["prompt"])
            except ValueError as exc:
                log.warning("worker %d: a conversation handed over was refused: %s", index, exc)
            continue
        while not free.acquire(timeout=0.5):
            if watch.gone:
                break
        else:
            thread = threading.Thread(target=answer, args=(job,), name=f"edgesync-slot-job-{job['id']}", daemon=True)
            with guard:
                running[thread] = job["id"]
            thread.start()
    log.info("worker %d: the server process %d is gone; closing the engine", index, watch.parent_pid)
    with guard:  # nobody reads the answers: each job stops at its next piece, then the engine closes
        for job_id in running.values():
            cancel.cancel(job_id)


def run_idle(engine, cores: CoreShare | None) -> bool:
    """Run the engine's queued idle-time work while nothing needs the engine, as one step of
    ``cores`` when given; True when none is left."""
    if cores is None or not engine.idle.has_work:
        return engine.idle.run_pending()
    with cores.active(), cores.step():
        return engine.idle.run_pending()


def make_room(engine, cores: CoreShare | None, n_tokens: int) -> int:
    """Make room to inject a conversation of ``n_tokens`` (``EdgeSync.make_room``), given up when a
    request arrives. Returns the tokens still wanted (0: the room is there)."""
    t0 = time.perf_counter()
    with cores.active() if cores is not None else nullcontext(), cores.step() if cores is not None else nullcontext():
        made = engine.make_room(n_tokens, engine.idle.busy)
    log.debug("room for injecting %d tokens %s in %.1f ms", n_tokens, "made" if made else "given up for a request",
              (time.perf_counter() - t0) * 1000)
    return 0 if made else n_tokens


def drain(engine, cancel: CancelBoard, watch: ParentWatch, index: int) -> bool:
    """Run queued idle-time work for at most :data:`STOP_DRAIN_S`, stopping when the server asks to skip
    it or is gone. True when the work is done."""
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
    """Answer one job dict (``id``, ``prompt`` (str or chat messages), ``max_tokens``,
    ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``reuse``) on ``engine``; returns the
    final message (``done``, ``error`` or ``cancelled``). Streamed pieces go through ``emit``
    (default: the response queue). With ``cores``, prefill and each later piece take their turn."""
    from edgesync_engines.adapters.protocol import ContextOverflowError  # imported by the engine's load

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
    """:func:`serve_one`'s generation loop, to a stop string, end, ``max_tokens`` or cancel; stores the prompt."""
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
    """Send a stream's first piece, waiting while no worker computes until it is written (else ``started``)."""

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
