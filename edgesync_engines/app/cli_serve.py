"""``edgesync serve``: the OpenAI-compatible server (:mod:`edgesync_engines.server`).

Default workers: one per 2 logical CPUs, 1 to 4, checked against memory and CPUs first
(:mod:`~edgesync_engines.server.capacity`); default slots per worker: :data:`SEQUENCES` // workers,
at least 1, lowered to what fits memory. llama.cpp workers of one slot share the CPU threads
(:mod:`~edgesync_engines.server.core_share`); otherwise each gets ``CPUs // workers``.
Idle-time storing is on unless ``--no-idle-store`` or ``EDGESYNC_IDLE_STORE`` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from edgesync_engines.adapters.threads import usable_cpus
from edgesync_engines.app.cli_common import (
    STORE_ARG_HELP,
    CommandError,
    int_at_least,
    load_config,
    positive_int,
    print_error,
)
from edgesync_engines.config import MAX_SLOTS
from edgesync_store.errors import require_extra

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS_LIMIT = 2048
UVICORN_GRACE_MARGIN_S = 1.0
"""Seconds uvicorn waits after ``--grace-seconds`` before cancelling, so the app answers those requests 503 itself."""


SEQUENCES = 4
"""Conversations a default server answers at once over all its workers (llama-server's default ``-np``)."""


def default_workers(cpus: int | None = None) -> int:
    """Engine processes for a machine with ``cpus`` logical CPUs (default: those this process may run on)."""
    cpus = cpus or usable_cpus()
    return max(1, min(4, cpus // 2))


def idle_store_override(no_idle_store: bool, environ=None) -> bool | None:
    """``idle_store`` for ``edgesync serve``: False with ``--no-idle-store``, None when
    ``EDGESYNC_IDLE_STORE`` is set (non-blank), else True."""
    if no_idle_store:
        return False
    environ = os.environ if environ is None else environ
    return None if (environ.get("EDGESYNC_IDLE_STORE") or "").strip() else True


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    value = int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {value}")
    return value


def add_parser(sub, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``edgesync serve`` on ``sub``; ``common`` holds ``--log-level``."""
    p = sub.add_parser("serve", parents=[common], description=__doc__.split("\n\n")[0],
                       help="an OpenAI-compatible HTTP server whose prompt cache survives restarts")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000; 0 = any free one)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help=f"engine processes (default {default_workers()} here: one per 2 CPUs, 1 to 4)")
    p.add_argument("--slots", type=int_at_least(1, MAX_SLOTS), default=None,
                   help=f"conversations each worker answers at once in one llama.cpp context (1 to {MAX_SLOTS}), "
                        f"their decode steps batched, answers identical to each alone (default: $EDGESYNC_SLOTS, "
                        f"else {SEQUENCES} // workers, at least 1, lowered to what fits memory)")
    p.add_argument("--model", default=None, help="model GGUF (default: the configured model)")
    p.add_argument("--store", default=None, help=STORE_ARG_HELP)
    p.add_argument("--api-key", default=os.environ.get("EDGESYNC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' (default: $EDGESYNC_API_KEY, else no key)")
    p.add_argument("--max-tokens-limit", type=positive_int, default=DEFAULT_MAX_TOKENS_LIMIT,
                   help=f"largest max_tokens a request may ask (default {DEFAULT_MAX_TOKENS_LIMIT})")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body, bytes (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--grace-seconds", type=int_at_least(0), default=10,
                   help="on SIGTERM or Ctrl-C, seconds in-flight requests may take to finish (default 10)")
    p.add_argument("--no-idle-store", action="store_true",
                   help="do not prefill and store each chat conversation with its answer between requests "
                        "(on by default here, unless EDGESYNC_IDLE_STORE=0: it costs CPU while the server is "
                        "idle and store bytes on disk for every turn's history; the next turn then prefills "
                        "only its new message)")
    p.set_defaults(func=cmd_serve)
    return p


def listening_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound and listening (CommandError when the address cannot be bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    # proto says TCP, and accepted sockets take the listening one's. With Nagle on, a stream's
    # first chunks wait for the client's delayed ACK of the headers (about 40 ms on Linux).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    return sock


class StopSignals:
    """SIGTERM and SIGINT handler installed before the workers start: records the first signal,
    which stops the pool's start or, once ``server`` is set, the server."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.server = None  # uvicorn's Server once made

    def install(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        # uvicorn re-raises the signal that stopped it once it has shut down: that ends here
        # too, instead of killing the process before the workers close the store
        if self.signum is None:
            self.signum = signum
        if self.server is not None:
            self.server.should_exit = True

    def requested(self) -> bool:
        """A signal arrived."""
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "no signal"


def model_path(cfg) -> Path:
    """The model file ``cfg`` names (default: SmolLM2), checked to exist (CommandError)."""
    from edgesync_engines.adapters.model_files import ModelNotFoundError, default_model_path

    try:
        model = Path(cfg.model_path) if cfg.model_path is not None else default_model_path()
    except ModelNotFoundError as exc:
        raise CommandError(f"model not found: {exc}") from None
    if not model.is_file():
        raise CommandError(f"model not found: {model}")
    return model


def worker_count(requested: int | None, model: Path, cfg) -> int:
    """The workers to start: ``--workers`` or :func:`default_workers`, checked by
    ``server.capacity.check_workers`` (CommandError when an explicit count does not fit)."""
    from edgesync_engines.server.capacity import WorkerCountError, available_memory, check_workers, worker_estimate

    try:
        return check_workers(requested or default_workers(), requested is not None,
                             worker_estimate(model, cfg.n_ctx, cfg.kv_type), cfg.n_ctx, usable_cpus(),
                             available_memory())
    except WorkerCountError as exc:
        raise CommandError(str(exc)) from None


def slot_count(requested: int | None, workers: int, model: Path, cfg) -> int:
    """Slots per worker: ``--slots``, else ``EDGESYNC_SLOTS``, else :data:`SEQUENCES` // ``workers``
    lowered until the workers fit memory (``server.capacity.check_slots``; CommandError when an
    explicit count does not fit). 1 for the onnx engine."""
    from edgesync_engines.server.capacity import WorkerCountError, available_memory, check_slots

    if (os.environ.get("EDGESYNC_SLOTS") or "").strip() and requested is None:
        requested = cfg.slots
    if cfg.engine != "llamacpp":
        if requested and requested > 1:
            log.warning("--slots %d: the onnx engine answers one sequence at a time; 1 slot", requested)
        return 1
    try:
        return check_slots(requested or max(1, SEQUENCES // workers), requested is not None, workers, model,
                           cfg.n_ctx, cfg.kv_type, available_memory())
    except WorkerCountError as exc:
        raise CommandError(str(exc)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    """``edgesync serve``: start the workers, then answer HTTP until SIGTERM or Ctrl-C (during the
    start: exit ``128 + signal number``). Raises MissingExtraError (no ``server`` extra) or
    CommandError (no model, too many ``--workers``, an unbindable address, an engine that won't load).

    The workers are started first (the first one, by the console script, before this module was
    imported: ``server/early.py``): FastAPI, uvicorn and the app are made while they load their
    engines, and the socket (bound before they start) is answered once every worker is ready.
    """
    # importing edgesync_engines.server looks the server extra up without importing it
    from edgesync_engines.server import early
    from edgesync_engines.server.pool import PoolStartError, WorkerPool
    from edgesync_engines.server.security import bind_warning
    from edgesync_engines.server.worker import STOP_DRAIN_S, worker_malloc_settings

    warning = bind_warning(args.host, args.api_key)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    cfg = load_config({"model_path": args.model, "store_path": args.store,
                       "idle_store": idle_store_override(args.no_idle_store)})
    model = model_path(cfg)
    if args.max_tokens_limit >= cfg.n_ctx:
        raise CommandError(f"--max-tokens-limit {args.max_tokens_limit} leaves no room for a prompt in the "
                           f"context of {cfg.n_ctx} tokens")
    workers = worker_count(args.workers, model, cfg)
    slots = slot_count(args.slots, workers, model, cfg)
    # llama.cpp sets its thread count per evaluation; ONNX Runtime's is fixed at load, and a
    # worker's slots run in threads of their own, so those workers split the CPUs once
    shared = workers > 1 and cfg.engine == "llamacpp" and slots == 1
    threads = cfg.n_threads or (usable_cpus() if shared or workers == 1 else max(1, usable_cpus() // workers))
    stop = StopSignals().install()
    sock = listening_socket(args.host, args.port)
    worker_malloc_settings()
    settings = {**cfg.to_dict(), "model_path": str(model), "n_threads": threads, "slots": slots}
    level = getattr(args, "log_level", "WARNING")
    pool = WorkerPool(settings, workers, log_level=level, shared_threads=threads if shared else None)
    try:
        pool.spawn(early.take())  # the console script's worker started early, if any
        server = http_server(pool, args, cfg, model, stop, level)
        pool.wait_ready(should_stop=stop.requested)
    except PoolStartError as exc:
        sock.close()
        if stop.requested():
            print_error(f"stopped by {stop.name} while the workers were starting; they are stopped")
            return 128 + stop.signum
        raise CommandError(str(exc)) from None
    except BaseException:  # the server extra cannot be imported, ...: the workers started are stopped
        pool.close()
        sock.close()
        raise
    try:
        stop.server = server
        if stop.requested():  # a signal since the workers started: uvicorn starts and stops at once
            stop.server.should_exit = True
        print(f"edgesync serve: listening on {describe(sock, cfg, model, workers, threads, shared, slots)}",
              file=sys.stderr, flush=True)
        stop.server.run(sockets=[sock])
    finally:
        if cfg.idle_store:
            print(f"edgesync serve: stopping; storing the conversations just answered first (up to "
                  f"{STOP_DRAIN_S:.0f} s; Ctrl-C again to skip)", file=sys.stderr, flush=True)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, frame: pool.skip_drain())
        pool.close()
        sock.close()
    print("edgesync serve: stopped; store closed", file=sys.stderr, flush=True)
    return 0


def http_server(pool, args: argparse.Namespace, cfg, model: Path, stop: StopSignals, level: str):
    """uvicorn's server of the app over ``pool``, its configuration loaded (the app wrapped, the
    protocol classes imported): made while the workers load, so that it answers as soon as they
    are ready. Imports the ``server`` extra (MissingExtraError when one of its modules cannot be
    imported)."""
    from edgesync_engines.server import SERVER_MODULES

    uvicorn = {module: require_extra(module, "server", "edgesync serve") for module in SERVER_MODULES}["uvicorn"]
    from edgesync_engines.server.app import ServeSettings, create_app, warm_streaming

    app = create_app(pool, ServeSettings(model_id=model.stem, store=Path(cfg.store_path),
                                         max_tokens_limit=args.max_tokens_limit,
                                         default_max_tokens=min(cfg.max_tokens, args.max_tokens_limit),
                                         max_body_bytes=args.max_body_bytes, api_key=args.api_key,
                                         shutdown_grace_s=float(args.grace_seconds)),
                     stopping=lambda: stop.server is not None and stop.server.should_exit)
    config = uvicorn.Config(app, log_config=None, log_level=level.lower(), access_log=False,
                            # after the app's own 503s (ServeSettings.shutdown_grace_s)
                            timeout_graceful_shutdown=args.grace_seconds + UVICORN_GRACE_MARGIN_S)
    config.load()
    asyncio.run(warm_streaming())
    log.debug("the HTTP server is made; waiting for the workers")
    return uvicorn_server(uvicorn, config)


def uvicorn_server(uvicorn, config):
    """uvicorn's ``Server`` for ``config`` whose forced exit (a second Ctrl-C) still ends the app's
    lifespan (else a traceback is logged)."""

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            if self.force_exit:
                await self.lifespan.shutdown()

    return Server(config)


def describe(sock: socket.socket, cfg, model: Path, workers: int, threads: int, shared: bool, slots: int = 1) -> str:
    """The "listening" line's end: the URL, the model, the workers and their slots, the cache."""
    host, port = sock.getsockname()[:2]
    caching = (f"store {cfg.store_path}, idle-time storing {'on' if cfg.idle_store else 'off'}"
               if cfg.cache_enabled else "cache off (EDGESYNC_CACHE=0): nothing is stored or reused")
    thread_s = f"{threads} thread{'s' if threads > 1 else ''}"
    engines = (f"{workers} workers sharing {thread_s}" if shared
               else f"{workers} worker{'s' if workers > 1 else ''} x {thread_s}")
    engines += f", {slots} slots each" if slots > 1 else ""
    return f"http://{host}:{port}/v1 (model {model.stem}, {engines}, {caching})"
