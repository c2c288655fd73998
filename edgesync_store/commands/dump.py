"""The ``dump`` command shared by ``edgesync dump`` and ``tools/dump.py``: command code that
prints, on top of the pure report functions of :mod:`edgesync_store.commands.inventory`."""

from __future__ import annotations

import json
import os
import sys

from edgesync_store.commands.inventory import (
    load_lifetime_summary,
    load_report,
    render_lifetime_table,
    render_table,
    wide_console,
)
from edgesync_store.errors import StoreBusyError, StoreError, StoreNotFoundError, StoreOpenError


def print_dump(path: str | os.PathLike, *, as_json: bool = False, limit: int | None = None,
               summary_only: bool = False, out=None, err=None) -> int:
    """The ``dump`` command shared by ``edgesync dump`` and ``tools/dump.py``.

    Writes a table (or with ``as_json`` one JSON object ``{"fragments": [...], "summary":
    {...}}``) to the rich console ``out`` (default: :func:`wide_console` on stdout), or one
    ``error: ...`` line to the text stream ``err`` (default: stderr). With ``summary_only``,
    instead of one line per fragment: the counts and bytes by lifetime (short, long, document, expired,
    total), the budget use and the size of ``data.mdb`` (``report.lifetime_summary``; its document
    as JSON with ``as_json``; ``limit`` is then ignored). Returns the exit status: 0, or 2 when
    there is no readable store at ``path`` (a missing directory is not created). The store is
    opened read-only.
    """
    err = err or sys.stderr
    try:
        doc = load_lifetime_summary(path) if summary_only else load_report(path, limit)
    except (StoreNotFoundError, StoreOpenError, StoreBusyError) as exc:
        print(f"error: {exc}", file=err, flush=True)
        return 2
    except (StoreError, OSError) as exc:  # StoreFormatError, StoreIOError
        print(f"error: cannot read the store at {path}: {exc}", file=err, flush=True)
        return 2
    out = out or wide_console()
    if as_json:
        out.file.write(json.dumps(doc, indent=2) + "\n")
        out.file.flush()
    else:
        out.print(render_lifetime_table(doc) if summary_only else render_table(doc))
    return 0
