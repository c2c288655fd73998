"""The app surface: the ``edgesync`` command (:mod:`.cli`, which lists its subcommand modules).

Nothing here is imported by the request path or the store.
"""

from __future__ import annotations

import signal
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The ``edgesync`` console script: :func:`.cli.main`, whose modules load inside this
    function so that a Ctrl-C while they load (before :func:`.cli.main` handles one) exits
    128 + SIGINT with one line, as it does once the command runs, rather than a traceback."""
    try:
        from edgesync_engines.app import cli
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    return cli.main(argv)
