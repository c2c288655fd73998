#!/usr/bin/env python3
"""Show what an EdgeSync fragment store holds, one line per fragment (headers only).

Usage: ``python tools/dump.py [STORE] [--json] [--limit N] [--summary]``

STORE defaults to the configured store (``EDGESYNC_STORE`` or the per-user cache dir). The store
is opened read-only; a missing directory prints ``error: no store at PATH``, exits 2 and is not
created. Each fragment line shows its lifetime (short / long / document), hits, last use and expiry (ISO time
and seconds left, or "expired"). ``--json`` prints ``{"fragments": [...], "summary": {...}}``.
``--summary`` prints, instead of the fragment lines, the fragments, stored (compressed) bytes,
raw bytes and hits by lifetime (short, long, document, expired, total), the budget use (used_bytes of
max_bytes) and the size of data.mdb; with ``--json`` as one JSON object.

A plain script: it runs from a checkout without installing anything beyond the dependencies
(the project root is put on ``sys.path``, and ``migrations/`` loaded as
``edgesync_store.migrations``, when ``edgesync_store`` is not importable).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

try:
    import edgesync_store  # noqa: F401
except ImportError:  # running from a checkout that is not installed
    ROOT = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(ROOT))
    # migrations/ installs as edgesync_store.migrations (pyproject.toml, package-dir): load it so
    spec = importlib.util.spec_from_file_location("edgesync_store.migrations", ROOT / "migrations" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "migrations")])
    sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[spec.name])

from edgesync_store.commands.dump import print_dump  # noqa: E402


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def default_store() -> Path:
    """The configured store directory (defaults < environment; the store's settings alone)."""
    from edgesync_store.settings import StoreSettings

    return StoreSettings.load().store_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dump.py", description="List the fragments of an EdgeSync store.")
    parser.add_argument("store", nargs="?", help="store directory (default: the configured store)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--limit", type=_positive_int, default=None, help="show at most N fragments")
    parser.add_argument("--summary", action="store_true",
                        help="counts and bytes by lifetime (short, long, document, expired, total) and the budget use, "
                             "instead of one line per fragment")
    args = parser.parse_args(argv)
    if args.store is None:
        try:
            store = default_store()
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        store = Path(args.store)
    return print_dump(store, as_json=args.json, limit=args.limit, summary_only=args.summary)


if __name__ == "__main__":
    raise SystemExit(main())
