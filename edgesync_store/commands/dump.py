"""The ``dump`` command of ``edgesync dump`` and ``tools/dump.py`` (prints
:mod:`~edgesync_store.commands.inventory`'s report)."""

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
    """Print the store at ``path`` (opened read-only): a table, or with ``as_json`` one object
    ``{"fragments": [...], "summary": {...}}``, on ``out`` (default :func:`wide_console`);
    ``summary_only``: the lifetime summary instead of rows (``limit`` ignored). Errors are one
    ``error: ...`` line on ``err``. Returns 0, or 2 when there is no readable store."""
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
