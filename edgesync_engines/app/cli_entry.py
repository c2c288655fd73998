"""The ``edgesync`` console script's entry point: :func:`main` loads the command (:mod:`.cli`)
inside its own ``try``, so that a Ctrl-C while the command's modules load exits 128 + SIGINT
with one line, as it does once the command runs, rather than a traceback."""

from __future__ import annotations

import signal
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run :func:`.cli.main` (``argv``: the arguments, default ``sys.argv[1:]``); return its exit
    status, or 128 + SIGINT after a Ctrl-C before it handles one."""
    try:
        from edgesync_engines.app import cli
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    return cli.main(argv)
