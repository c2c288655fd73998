"""The ``edgesync`` console script: :func:`main` imports the command inside its own ``try``, so a
Ctrl-C while it loads exits 128 + SIGINT with one line. For ``edgesync serve`` it first starts the
server's first worker process (``server/early.py``), which imports the engine meanwhile."""

from __future__ import annotations

import signal
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run :func:`.cli.main` (``argv``: the arguments, default ``sys.argv[1:]``); return its exit
    status, or 128 + SIGINT after a Ctrl-C before it handles one."""
    args = list(sys.argv[1:] if argv is None else argv)
    early = None
    try:
        try:
            if args[:1] == ["serve"] and not {"-h", "--help"} & set(args):
                early = early_worker()
            from edgesync_engines.app import cli
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr, flush=True)
            return 128 + signal.SIGINT
        return cli.main(args)
    finally:
        if early is not None:  # killed unless the server adopted it
            early.discard()


def early_worker():
    """``server.early`` with its worker started, or None: no ``server`` extra (the command then
    says so), or a process that could not be started (the server starts its workers itself)."""
    try:
        from edgesync_engines.server import early
    except ImportError:
        return None
    try:
        early.begin()
    except OSError:
        early.discard()
    return early
