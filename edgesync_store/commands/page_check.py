"""``python -m edgesync_store.commands.page_check STORE [--json]``: the page check of ``data.mdb``
in this process (``edgesync_store.core.page_check`` runs it as a child). Exit 0 healthy, 1 damaged, 2 no
readable store; ``--json``: ``healthy``, ``damage``, ``header``, ``databases``, ``pages``,
``txnid``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgesync_store.core.check import check_file

EXIT_HEALTHY, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m edgesync_store.commands.page_check",
                                     description="Check the LMDB pages of an EdgeSync store.")
    parser.add_argument("store", help="store directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    data = Path(args.store).expanduser() / "data.mdb"
    try:
        report = check_file(data)
    except OSError as exc:
        print(f"error: no readable store at {args.store}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report.to_dict()))
    elif report.healthy:
        print(f"{args.store}: healthy ({len(report.databases)} databases, {report.pages} pages, "
              f"transaction {report.txnid})")
    else:
        print(f"{args.store}: damaged: {report.damage}")
    return EXIT_HEALTHY if report.healthy else EXIT_DAMAGED


if __name__ == "__main__":
    sys.exit(main())
