"""How many CPU threads an engine uses by default."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The logical CPUs this process may run on: its CPU affinity where the platform has one
    (Linux ``sched_getaffinity``: a container's cpuset or ``taskset`` narrows it), else
    ``os.cpu_count()``; at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
