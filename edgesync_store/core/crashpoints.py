"""Named crash points for the crash-safety tests: ``crash_point("reclaim.renamed")`` sends this
process SIGKILL when ``EDGESYNC_CRASH_POINT`` names the point (``NAME``: its first pass,
``NAME@N``: its N-th pass in this process); otherwise it costs a dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV_VAR = "EDGESYNC_CRASH_POINT"
_passes: Counter[str] = Counter()


def crash_point(name: str) -> None:
    """SIGKILL this process here when ``EDGESYNC_CRASH_POINT`` names ``name`` (see module)."""
    target = os.environ.get(ENV_VAR)
    if not target:
        return
    point, _, nth = target.partition("@")
    if point != name:
        return
    _passes[name] += 1
    if _passes[name] >= (int(nth) if nth.isdigit() else 1):
        os.kill(os.getpid(), signal.SIGKILL)
