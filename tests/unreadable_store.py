"""A real store that the test's child process may not read, for the permission tests of
``test_loading``, ``test_clear`` and ``test_dump_lifecycle``.

Root reads any directory, so the child drops to ``nobody`` (uid/gid 65534) after its imports
when it runs as root; otherwise the mode bits alone refuse it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from edgesync_store.core.store import FragmentStore

ROOT = Path(__file__).resolve().parents[1]

BECOME_NOBODY = """
import os
if os.geteuid() == 0:  # root reads any directory: become nobody
    os.setgid(65534)
    os.setuid(65534)
"""
"""Child code to run after its imports and before it touches the store."""


def run_on_unreadable_store(closed: str, child_code: str):
    """Create a store at ``BASE/parent/store`` (BASE a fresh directory under the system's temp
    directory, since pytest's ``tmp_path`` has parents private to root), set mode 000 on the
    store directory (``closed="store"``) or on its parent (``closed="parent"``), run
    ``python -c child_code STORE_PATH`` from the repository root, restore the modes and remove
    BASE.

    Returns:
        ``(store_path, completed_process)`` (text output captured).
    """
    base = Path(tempfile.mkdtemp())
    path = base / "parent" / "store"
    try:
        os.chmod(base, 0o755)
        FragmentStore(path).close()
        os.chmod(path.parent, 0o755)
        os.chmod(path if closed == "store" else path.parent, 0)
        child = subprocess.run([sys.executable, "-c", child_code, str(path)], capture_output=True, text=True,
                               cwd=ROOT, timeout=120)
    finally:
        for opened in (path.parent, path):  # the parent first, so that the store can be reached
            if os.path.lexists(opened):
                os.chmod(opened, 0o700)
        shutil.rmtree(base)
    return path, child
