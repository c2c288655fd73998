"""Named crash points: fault injection for the crash-safety tests (a fake kill, used because a
kill at an exact moment cannot be provoked from outside).

``crash_point("reclaim.renamed")`` does nothing unless the environment variable
``EDGESYNC_CRASH_POINT`` names that point (``NAME`` for its first pass, ``NAME@N`` for its N-th
pass in this process); then the process sends itself SIGKILL right there, as a phone's OS or a
user's kill would. The variable is read at each call (a dictionary lookup), so the points cost
nothing in normal runs.
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
