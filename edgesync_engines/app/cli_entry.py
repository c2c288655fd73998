"""The ``edgesync`` console script: :func:`main` imports the command inside its own ``try``, so a
Ctrl-C while it loads exits 128 + SIGINT with one line."""

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
