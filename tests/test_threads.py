"""usable_cpus follows the process's CPU affinity (a real child process narrowed to one CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgesync_engines.adapters.threads import usable_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")


def test_usable_cpus_counts_the_cpus_of_the_affinity_mask():
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_a_process_narrowed_to_one_cpu_uses_one_thread_and_serves_with_one_worker():
    one = min(os.sched_getaffinity(0))
    code = ("import os; os.sched_setaffinity(0, {%d}); "
            "from edgesync_engines.adapters.threads import usable_cpus; "
            "from edgesync_engines.app.cli_serve import default_workers; "
            "print(usable_cpus(), default_workers())" % one)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1"]
