"""What a fragment store holds, as rows and a summary, for ``edgesync dump`` and ``tools/dump.py``.

Everything here reads headers only (``FragmentStore.iterate``: no decompression). The row and
summary functions are pure; :func:`render_table` builds a rich Table; the command that prints
them is :mod:`edgesync_store.cli_dump`.

Units: sizes are bytes, times are Unix seconds (plus an ISO-8601 local time with offset),
``expires_in_s`` is seconds from now (negative once expired).
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from .store import FragmentStore

__all__ = [
    "StoreNotFoundError",
    "format_bytes",
    "fragment_rows",
    "iso_time",
    "load_report",
    "open_store_readonly",
    "render_table",
    "summary",
    "wide_console",
]

KEY_PREFIX_CHARS = 12
FINGERPRINT_PREFIX_CHARS = 12

class StoreNotFoundError(FileNotFoundError):
    """There is no store directory at the given path (nothing is created)."""

def iso_time(t: float | None) -> str | None:
    """ISO-8601 local time with offset, to the second; None for 0/None (never happened)."""
    if not t:
        return None
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")

def format_bytes(n: int | float | None) -> str:
    """Human-readable decimal size: ``'6.8 MB'``; ``'-'`` for None."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover

def fragment_rows(store: FragmentStore, now: float | None = None) -> list[dict[str, Any]]:
    """One JSON-able row per stored fragment, oldest first (corrupt rows last).

    Row fields: ``key`` (first 12 hex chars of the store key), ``corrupt`` (the header does not
    parse; the other header fields are then None), ``tokens`` ``"start-end"``, ``span`` (tokens),
    ``layers`` ``"start:end:stride"``, ``heads`` ``"start:end"``, ``raw_bytes`` (K+V before
    compression), ``compressed_bytes`` (the stored blob), ``hits``, ``last_hit`` (ISO or None),
    ``last_hit_at``, ``expires`` (ISO), ``expires_at``, ``expires_in_s``, ``expired``,
    ``engine``, ``model`` (first 12 hex chars of the model fingerprint), ``created`` (ISO).
    """
    now = time.time() if now is None else now
    rows: list[dict[str, Any]] = []
    for key, head, life, nbytes in store.iterate():
        expires_at = life.expires_at or (head.expires_at if head is not None else 0.0)
        row: dict[str, Any] = {
            "key": key.hex()[:KEY_PREFIX_CHARS],
            "corrupt": head is None,
            "tokens": None,
            "span": None,
            "layers": None,
            "heads": None,
            "raw_bytes": None,
            "compressed_bytes": nbytes,
            "hits": life.hit_count,
            "last_hit": iso_time(life.last_hit_at),
            "last_hit_at": life.last_hit_at or None,
            "expires": iso_time(expires_at),
            "expires_at": expires_at or None,
            "expires_in_s": round(expires_at - now, 1) if expires_at else None,
            "expired": bool(expires_at) and expires_at <= now,
            "engine": None,
            "model": None,
            "created": None,
            "created_at": None,
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
                created=iso_time(head.created_at),
                created_at=head.created_at,
            )
        rows.append(row)
    rows.sort(key=lambda r: (r["corrupt"], r["created_at"] or 0.0, r["span"] is None, r["tokens"] or ""))
    return rows

def summary(store: FragmentStore) -> dict[str, Any]:
    """``store.stats()`` as a dict plus the store path and the compression ratio (raw/compressed)."""
    stats = store.stats().to_dict()
    stats["path"] = str(store.path)
    stats["compression_ratio"] = (
        round(stats["raw_bytes"] / stats["compressed_bytes"], 3) if stats["compressed_bytes"] else None
    )
    return stats

def open_store_readonly(path: str | os.PathLike) -> FragmentStore:
    """Open an existing store without writing to it.

    Raises:
        StoreNotFoundError: no directory at ``path`` (it is not created).
        StoreOpenError: the directory holds no EdgeSync store.
        lmdb.Error, StoreFormatError: the directory is not a readable EdgeSync store.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise StoreNotFoundError(f"no store at {path}")
    return FragmentStore(path, readonly=True)

def load_report(path: str | os.PathLike, limit: int | None = None) -> dict[str, Any]:
    """``{"fragments": rows (the first ``limit``), "summary": summary}`` of the store at ``path``."""
    with open_store_readonly(path) as store:
        rows = fragment_rows(store)
        summ = summary(store)
    summ["shown"] = len(rows) if limit is None else min(limit, len(rows))
    return {"fragments": rows if limit is None else rows[:limit], "summary": summ}

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
        ("raw", "right"), ("stored", "right"), ("hits", "right"), ("last hit", "left"),
        ("expires", "left"), ("left (s)", "right"), ("namespace", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=name in ("key", "tokens", "layers", "last hit", "expires"))
    for row in report["fragments"]:
        if row["corrupt"]:
            table.add_row(row["key"], "[red]corrupt[/red]", "-", "-", "-", format_bytes(row["compressed_bytes"]),
                          str(row["hits"]), row["last_hit"] or "-", row["expires"] or "-", "-", "-")
            continue
        left = row["expires_in_s"]
        table.add_row(
            row["key"],
            row["tokens"],
            row["layers"],
            row["heads"],
            format_bytes(row["raw_bytes"]),
            format_bytes(row["compressed_bytes"]),
            str(row["hits"]),
            row["last_hit"] or "-",
            row["expires"] or "-",
            "-" if left is None else ("[red]expired[/red]" if row["expired"] else f"{left:.0f}"),
            f"{row['engine']} {row['model']}",
        )
    return table
