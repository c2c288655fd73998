"""Running the ``edgesync`` command as a subprocess from the checkout, for the command-line tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEEP_ENV = {"EDGESYNC_MODEL", "EDGESYNC_WORKLOADS", "EDGESYNC_THREADS"}


def cli_env(**extra: str) -> dict[str, str]:
    """The environment without EDGESYNC_* settings that would change what is tested, with tables
    200 columns wide (whatever width the runner's terminal or worker process says), so that the
    tests can find whole values in them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESYNC_") or k in KEEP_ENV}
    env["COLUMNS"] = "200"
    env.update(extra)
    return env


def edgesync(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m edgesync_engines.app.cli ARGS`` from the checkout (600 s at most)."""
    return subprocess.run(
        [sys.executable, "-m", "edgesync_engines.app.cli", *args],
        capture_output=True, text=True, cwd=ROOT, env=env or cli_env(), timeout=600,
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``proc``, asserting it exited 0 (its output in the message when not)."""
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc
