"""What a fragment store holds, as rows and a summary, for ``edgesync dump`` and ``tools/dump.py``.

Reads headers only (no decompression). Sizes are bytes, times Unix seconds (with ISO-8601 local
times), ``expires_in_s`` seconds from now (negative once expired).
"""

from __future__ import annotations

import math
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from edgesync_store.commands.units import format_binary, format_bytes
from edgesync_store.core.backend import MaintenanceBackend
from edgesync_store.core.lmdb_env import path_state
from edgesync_store.core.store import FragmentStore
from edgesync_store.errors import StoreNotFoundError, StoreOpenError
from edgesync_store.ttl import LIFETIME_DOCUMENT, LIFETIME_LONG, LIFETIME_SHORT

__all__ = ["StoreNotFoundError", "fragment_rows", "iso_time", "lifetime_summary", "load_lifetime_summary",
           "load_report", "open_store_readonly", "render_lifetime_table", "render_table", "summary", "wide_console"]

KEY_PREFIX_CHARS = 12
FINGERPRINT_PREFIX_CHARS = 12
EXPIRED = "expired"
TOTAL = "total"
SUMMARY_ROWS = (LIFETIME_SHORT, LIFETIME_LONG, LIFETIME_DOCUMENT, EXPIRED, TOTAL)
"""Rows of :func:`lifetime_summary`: live short, live long, documents, expired, all."""

def iso_time(t: float | None) -> str | None:
    """ISO-8601 local time with offset, to the second; None for 0/None (never happened)."""
    if not t:
        return None
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")

def fragment_rows(store: MaintenanceBackend, now: float | None = None) -> list[dict[str, Any]]:
    """One JSON-able row per stored fragment, oldest first (corrupt rows last).

    Row fields: ``key`` (12 hex chars), ``corrupt`` (header unparsable; other header fields None),
    ``tokens`` ``"start-end"``, ``span``, ``layers`` ``"start:end:stride"``, ``heads``
    ``"start:end"``, ``raw_bytes`` (K+V uncompressed), ``compressed_bytes``, ``lifetime`` (as
    stored), ``hits``, ``last_hit``/``last_hit_at``, ``last_used``/``last_used_at`` (later of last
    hit and creation), ``expires``/``expires_at``, ``expires_in_s``, ``expired`` (``expires_at <=
    now``, or no lifecycle record), ``engine``, ``model`` (12 hex chars of the fingerprint),
    ``created``/``created_at``.

    Args:
        store: an open store (read-only is enough).
        now: Unix seconds the expiry is judged at (default: the store's clock).
    """
    now = store.clock() if now is None else now
    rows: list[dict[str, Any]] = []
    for key, head, life, nbytes in store.iterate():
        expires_at = life.expires_at
        created_at = life.created_at or (head.created_at if head is not None else 0.0)
        last_used_at = max(life.last_hit_at, created_at)
        row: dict[str, Any] = {
            "key": key.hex()[:KEY_PREFIX_CHARS],
            "corrupt": head is None,
            "tokens": None,
            "span": None,
            "layers": None,
            "heads": None,
            "raw_bytes": None,
            "compressed_bytes": nbytes,
            "lifetime": life.lifetime,
            "hits": life.hit_count,
            "last_hit": iso_time(life.last_hit_at),
            "last_hit_at": life.last_hit_at or None,
            "last_used": iso_time(last_used_at),
            "last_used_at": last_used_at or None,
            # a document's fragment never expires (+inf): JSON has no infinity, so None
            "expires": iso_time(expires_at) if math.isfinite(expires_at) else None,
            "expires_at": expires_at if expires_at and math.isfinite(expires_at) else None,
            "expires_in_s": round(expires_at - now, 1) if expires_at and math.isfinite(expires_at) else None,
            "expired": life.expired(now),
            "engine": None,
            "model": None,
            "created": iso_time(created_at),
            "created_at": created_at or None,
        }
        if head is not None:
            row.update(
                tokens=f"{head.token_start}-{head.token_end}",
                span=head.span,
                layers=f"{head.layer_start}:{head.layer_end}:{head.layer_stride}",
                heads=f"{head.head_start}:{head.head_end}",
                raw_bytes=head.raw_nbytes,
                engine=head.namespace.engine,
                model=head.namespace.model_fingerprint[:FINGERPRINT_PREFIX_CHARS],
            )
        rows.append(row)
    rows.sort(key=lambda r: (r["corrupt"], r["created_at"] or 0.0, r["span"] is None, r["tokens"] or ""))
    return rows

def summary(store: MaintenanceBackend) -> dict[str, Any]:
    """``store.stats()`` as a dict plus the store path and the compression ratio (raw/compressed)."""
    stats = store.stats().to_dict()
    stats["path"] = str(store.path)
    stats["compression_ratio"] = (
        round(stats["raw_bytes"] / stats["compressed_bytes"], 3) if stats["compressed_bytes"] else None
    )
    return stats

def _empty_counts() -> dict[str, int]:
    return {"fragments": 0, "stored_bytes": 0, "raw_bytes": 0, "hits": 0}


def lifetime_summary(store: MaintenanceBackend, now: float | None = None) -> dict[str, Any]:
    """Counts and sizes of ``store`` by lifetime, as a JSON-able dict: ``path``, ``now``;
    ``lifetimes``: ``{"short", "long", "document", "expired", "total"}`` -> ``{"fragments",
    "stored_bytes", "raw_bytes", "hits"}`` (an expired fragment counts in ``expired`` only);
    ``corrupt``; ``used_bytes``, ``max_bytes``, ``used_percent`` (2 decimals); ``data_mdb_bytes``
    (file size, free pages included). ``now``: Unix seconds (default: the store's clock)."""
    now = store.clock() if now is None else now
    lifetimes = {name: _empty_counts() for name in SUMMARY_ROWS}
    corrupt = 0
    for _key, head, life, nbytes in store.iterate():
        raw = head.raw_nbytes if head is not None else life.raw_nbytes
        corrupt += head is None
        for name in (EXPIRED if life.expired(now) else life.lifetime, TOTAL):
            row = lifetimes[name]
            row["fragments"] += 1
            row["stored_bytes"] += nbytes
            row["raw_bytes"] += raw
            row["hits"] += life.hit_count
    used, budget = store.used_bytes(), store.max_bytes
    data = store.path / "data.mdb"
    return {
        "path": str(store.path),
        "now": now,
        "lifetimes": lifetimes,
        "corrupt": corrupt,
        "used_bytes": used,
        "max_bytes": budget,
        "used_percent": round(100.0 * used / budget, 2) if budget else None,
        "data_mdb_bytes": data.stat().st_size if data.exists() else 0,
    }


def open_store_readonly(path: str | os.PathLike) -> FragmentStore:
    """Open an existing store without writing to it.

    Raises:
        StoreNotFoundError: nothing at ``path`` (it is not created).
        StoreOpenError: ``path`` is a file, holds no EdgeSync store, or cannot be read.
        StoreUnavailableError: the directory cannot be read (permission).
        lmdb.Error, StoreFormatError: not a readable EdgeSync store.
    """
    path = Path(path).expanduser()
    exists, is_dir, readable = path_state(path)
    if not readable:
        raise StoreOpenError(f"store path {path}: cannot be read (permission denied)")
    if not exists:
        raise StoreNotFoundError(f"no store at {path}")
    if not is_dir:
        raise StoreOpenError(f"store path {path}: exists and is not a directory")
    return FragmentStore(path, readonly=True)

def load_report(path: str | os.PathLike, limit: int | None = None, now: float | None = None) -> dict[str, Any]:
    """``{"fragments": the first ``limit`` rows, "summary": ...}`` of the store at ``path``, opened
    read-only (errors: :func:`open_store_readonly`). ``now``: Unix seconds (default ``time.time()``)."""
    now = time.time() if now is None else now
    with open_store_readonly(path) as store:
        rows = fragment_rows(store, now)
        summ = summary(store)
    summ["shown"] = len(rows) if limit is None else min(limit, len(rows))
    return {"fragments": rows if limit is None else rows[:limit], "summary": summ}


def load_lifetime_summary(path: str | os.PathLike, now: float | None = None) -> dict[str, Any]:
    """:func:`lifetime_summary` of the store at ``path``, opened read-only (never created; see
    :func:`open_store_readonly` for the errors). ``now``: Unix seconds (default ``time.time()``)."""
    now = time.time() if now is None else now
    with open_store_readonly(path) as store:
        return lifetime_summary(store, now)

def wide_console(stderr: bool = False, width: int = 200):
    """A rich Console; when the stream is not a terminal (a pipe, a file) and ``COLUMNS`` is not
    set, tables may be up to ``width`` characters wide instead of rich's default 80."""
    import sys

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    wide = not (hasattr(stream, "isatty") and stream.isatty()) and not os.environ.get("COLUMNS")
    return Console(stderr=stderr, width=width if wide else None)

def render_table(report: dict[str, Any]):
    """A rich Table of a :func:`load_report` document (one line per fragment)."""
    from rich.table import Table

    summ = report["summary"]
    ratio = summ.get("compression_ratio")
    table = Table(
        title=f"EdgeSync store {summ['path']}",
        caption=(
            f"{summ['shown']} of {summ['fragments']} fragments shown; "
            f"{format_bytes(summ['compressed_bytes'])} stored "
            f"({format_bytes(summ['raw_bytes'])} raw"
            + (f", ratio {ratio:.2f}" if ratio else "")
            + f"), {format_bytes(summ['disk_bytes'])} on disk, map {format_bytes(summ['map_size'])}"
        ),
    )
    for name, justify in (
        ("key", "left"), ("tokens", "right"), ("layers", "right"), ("heads", "right"),
        ("raw", "right"), ("stored", "right"), ("lifetime", "left"), ("hits", "right"), ("last hit", "left"),
        ("expires", "left"), ("left (s)", "right"), ("namespace", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=name in ("key", "tokens", "layers", "last hit", "expires"))
    for row in report["fragments"]:
        left = row["expires_in_s"]
        left_text = "[red]expired[/red]" if row["expired"] else ("-" if left is None else f"{left:.0f}")
        if row["corrupt"]:
            table.add_row(row["key"], "[red]corrupt[/red]", "-", "-", "-", format_bytes(row["compressed_bytes"]),
                          row["lifetime"], str(row["hits"]), row["last_hit"] or "-", row["expires"] or "-", left_text,
                          "-")
            continue
        table.add_row(row["key"], row["tokens"], row["layers"], row["heads"], format_bytes(row["raw_bytes"]),
                      format_bytes(row["compressed_bytes"]), row["lifetime"], str(row["hits"]), row["last_hit"] or "-",
                      row["expires"] or "-", left_text, f"{row['engine']} {row['model']}")
    return table


def render_lifetime_table(summ: dict[str, Any]):
    """A rich Table of a :func:`lifetime_summary` document: one row per lifetime (short, long,
    document), one for expired fragments and the total, the budget and the file size in the caption."""
    from rich.table import Table

    percent = summ["used_percent"]
    table = Table(
        title=f"EdgeSync store {summ['path']}",
        caption=(
            # binary units, as the budget is given (EDGESYNC_MAX_BYTES=1G is 1.0 GiB)
            f"used {format_binary(summ['used_bytes'])} of the {format_binary(summ['max_bytes'])} budget"
            + (f" ({percent:.1f}%)" if percent is not None else "")
            + f"; data.mdb {format_bytes(summ['data_mdb_bytes'])} on disk"
            + (f"; {summ['corrupt']} corrupt" if summ["corrupt"] else "")
        ),
    )
    for name in ("lifetime", "fragments", "stored", "raw", "hits"):
        table.add_column(name, justify="left" if name == "lifetime" else "right")
    for name in SUMMARY_ROWS:
        row = summ["lifetimes"][name]
        table.add_row(
            f"[bold]{name}[/bold]" if name == TOTAL else name,
            str(row["fragments"]),
            format_bytes(row["stored_bytes"]),
            format_bytes(row["raw_bytes"]),
            str(row["hits"]),
            end_section=name == EXPIRED,
        )
    return table
