"""The ``edgesync`` subcommands on a store without the model: ``dump``, ``check``, ``clear`` and
``reindex`` (``compact`` is :mod:`edgesync_store.compact`). Bad input raises
:class:`~edgesync_engines.app.cli_common.CommandError` (exit 2)."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from typing import Iterator

from edgesync_engines.app.cli_common import (
    STORE_ARG_HELP,
    CommandError,
    configured_store,
    load_config,
    positive_int,
    print_error,
)
from edgesync_engines.config import EMBEDDING_BACKENDS
from edgesync_store.commands.dump import print_dump
from edgesync_store.commands.units import format_bytes
from edgesync_store.errors import (
    MissingExtraError,
    StoreBusyError,
    StoreError,
    StoreFormatError,
    StoreNotFoundError,
    StoreOpenError,
)

EXIT_DAMAGED = 1
"""``edgesync check``'s exit status for a damaged store."""
EXIT_DECLINED = 1
"""``edgesync clear``'s exit status when the user answers no at the confirmation prompt."""
EXIT_REMOTE_FAILED = 3
"""Exit status of ``clear --remote`` when the local store was cleared and the remote tier not."""


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """Register ``dump``, ``check``, ``clear`` and ``reindex`` on ``sub`` (the subparsers of
    ``cli.build_parser``); ``common`` is the parent parser holding ``--log-level``."""
    dump = sub.add_parser("dump", parents=[common], help="list the fragments of a store (read-only)")
    dump.add_argument("store", nargs="?", help=STORE_ARG_HELP)
    dump.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    dump.add_argument("--limit", type=positive_int, help="show at most N fragments")
    dump.add_argument("--summary", action="store_true",
                      help="counts and bytes by lifetime (short, long, document, expired, total) and the budget use, "
                           "instead of one line per fragment")
    dump.set_defaults(func=cmd_dump)

    chk = sub.add_parser("check", parents=[common],
                         help="check a store's LMDB pages (exit 0 healthy, 1 damaged; read-only)")
    chk.add_argument("store", nargs="?", help=STORE_ARG_HELP)
    chk.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    chk.set_defaults(func=cmd_check)

    clear = sub.add_parser("clear", parents=[common],
                           help="erase everything a store holds (fragments, index, donors, vectors, sidecar)")
    clear.add_argument("store", nargs="?", help=STORE_ARG_HELP)
    clear.add_argument("--yes", "-y", action="store_true",
                       help="do not ask for confirmation (required when stdin is not a terminal)")
    clear.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    clear.add_argument("--remote", action="store_true",
                       help="also remove every key of the shared remote tier under the key prefix "
                            "(EDGESYNC_REMOTE_URL, EDGESYNC_REMOTE_PREFIX): for every node of the site")
    clear.set_defaults(func=cmd_clear)

    reindex = sub.add_parser("reindex", parents=[common],
                             help="rebuild a store's semantic index (HNSW sidecar) from LMDB")
    reindex.add_argument("store", nargs="?", help=STORE_ARG_HELP)
    reindex.add_argument("--backend", choices=EMBEDDING_BACKENDS,
                         help="embedding backend; another than the store's re-embeds every stored prompt")
    reindex.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    reindex.set_defaults(func=cmd_reindex)


@contextmanager
def _command_errors(context: str, own_message: tuple[type[Exception], ...]) -> Iterator[None]:
    """Turn a store command's failures into :class:`CommandError`: ``own_message`` types as they
    are, any other :class:`StoreError` or ``OSError`` as ``"<context>: <error>"``."""
    try:
        yield
    except own_message as exc:
        raise CommandError(str(exc)) from None
    except (StoreError, OSError) as exc:
        raise CommandError(f"{context}: {exc}") from None


def cmd_dump(args: argparse.Namespace) -> int:
    """``edgesync dump``: :func:`edgesync_store.commands.dump.print_dump`; its exit status."""
    return print_dump(configured_store(args.store), as_json=args.json, limit=args.limit, summary_only=args.summary)


def _confirm(question: str) -> bool:
    """Ask ``question`` on the terminal (stderr); True only for an explicit yes."""
    from rich.console import Console
    from rich.prompt import Confirm

    try:
        return Confirm.ask(question, console=Console(stderr=True), default=False)
    except EOFError:
        return False


def cmd_check(args: argparse.Namespace) -> int:
    """``edgesync check``: the page check in a child process; one line, or JSON with ``--json``
    (``healthy``, ``damage``, ``header``, ``databases``, ``pages``, ``txnid``). Exit 0 healthy,
    :data:`EXIT_DAMAGED` damaged, 2 no store."""
    from pathlib import Path

    from edgesync_store.core import page_check as check
    from edgesync_store.core.check import has_data_file, opened_as_store

    path = Path(configured_store(args.store)).expanduser()
    if not has_data_file(path):
        raise CommandError(f"no EdgeSync store at {path}")
    report = check.verify(path)
    if not report.healthy and not opened_as_store(path):
        # never opened as a store: a foreign file, which `edgesync clear` refuses to erase too
        raise CommandError(f"no EdgeSync store at {path}: its data.mdb is not one ({report.damage})")
    if args.json:
        print(json.dumps({"store": str(path), **report.to_dict()}))
    elif report.healthy:
        print(f"{path}: healthy ({len(report.databases)} databases, {report.pages} pages)")
    else:
        print(f"{path}: damaged: {report.damage}; `edgesync clear {path} --yes` erases and recreates it "
              "(it is a cache)")
    return 0 if report.healthy else EXIT_DAMAGED


def cmd_clear(args: argparse.Namespace) -> int:
    """``edgesync clear``: ``clear_store`` after a confirmation (or ``--yes``), then with
    ``--remote`` the shared tier's keys. Exit 0; 1 declined; 2 bad input or no ``--yes`` without a
    terminal; :data:`EXIT_REMOTE_FAILED` when only the local store was cleared."""
    from edgesync_store.commands.clear import check_store_path, clear_store

    store = configured_store(args.store)
    cfg = load_config({})
    if args.remote and cfg.remote_url is None:
        raise CommandError("--remote: no remote tier is configured (set EDGESYNC_REMOTE_URL)")
    if args.remote:  # without redis-py, refused before anything is erased
        try:
            from edgesync_store.remote import commands  # noqa: F401
        except MissingExtraError as exc:
            raise CommandError(str(exc)) from None
    try:
        path = check_store_path(store)
    except (StoreNotFoundError, StoreOpenError) as exc:
        raise CommandError(str(exc)) from None
    remote = f" and every key under {cfg.remote_prefix}: on {cfg.remote_url}" if args.remote else ""
    if not args.yes:
        if not sys.stdin.isatty():
            raise CommandError(f"refusing to clear {path} without --yes (stdin is not a terminal to confirm on)")
        if not _confirm(f"Erase every fragment, donor and vector of the store at {path}{remote}?"):
            print(f"not cleared: {path} left as it was", file=sys.stderr, flush=True)
            return EXIT_DECLINED
    untouched = "; the remote tier was not cleared" if args.remote else ""
    with _command_errors(f"cannot clear the store at {path}{untouched}",
                         (StoreNotFoundError, StoreOpenError, StoreFormatError, StoreBusyError)):
        result = clear_store(path)
    doc = result.to_dict()
    how = ("files erased (" + ", ".join(result.files_removed) + ") and an empty store created"
           if result.erased_files else f"files not erased: {result.reason}")
    summary = (f"cleared {result.path}: {result.fragments_removed} fragments removed; data.mdb "
               f"{format_bytes(result.bytes_before)} -> {format_bytes(result.bytes_after)}; {how}")
    failed = None
    if args.remote:
        failed = _clear_remote(cfg, doc)
        summary += (f"; remote tier {cfg.remote_url}: " + (f"{doc['remote_keys_removed']} keys under "
                    f"{cfg.remote_prefix}: removed" if failed is None else f"not cleared: {failed}"))
    print(json.dumps(doc) if args.json else summary, flush=True)
    if failed is not None:
        print_error(f"the local store was cleared, the remote tier was not: {failed}")
        return EXIT_REMOTE_FAILED
    return 0


def _clear_remote(cfg, doc: dict) -> str | None:
    """Clear the remote tier of ``cfg``; sets ``doc["remote_keys_removed"]`` (None when it failed)
    and ``doc["remote_error"]`` (None when it did not). Returns the error, or None."""
    doc["remote_keys_removed"], doc["remote_error"] = None, None
    try:
        from edgesync_store.remote.commands import clear_remote

        doc["remote_keys_removed"] = clear_remote(cfg.remote_url, cfg.remote_prefix, cfg.remote_cluster,
                                                  cfg.remote_write_timeout_ms)
    except (ImportError, ValueError, StoreError, OSError) as exc:  # their messages show the URL redacted
        doc["remote_error"] = str(exc)
    return doc["remote_error"]


def cmd_reindex(args: argparse.Namespace) -> int:
    """``edgesync reindex``: :func:`edgesync_store.semantic.reindex.reindex` with a progress bar on
    stderr; the report on stdout."""
    from rich.console import Console
    from rich.progress import Progress

    from edgesync_store.semantic.embedders import EmbeddingUnavailableError
    from edgesync_store.semantic.index import BackendMismatchError, IndexUnavailableError
    from edgesync_store.semantic.reindex import reindex

    store = configured_store(args.store)
    if not str(store).strip():
        raise CommandError("store path: is empty")
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = None

        def progress(stage: str, done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task(stage, total=total)
            bar.update(task, completed=done, description=stage)

        with _command_errors(f"store {store}", (StoreOpenError, StoreFormatError, ValueError,
                                                EmbeddingUnavailableError, IndexUnavailableError,
                                                BackendMismatchError)):
            report = reindex(store, backend=args.backend, progress=progress)
    if args.json:
        print(json.dumps(report.to_dict()), flush=True)
    else:
        dropped = (f", {report.vectors_dropped} vectors of {report.previous_backend_id} dropped"
                   if report.vectors_dropped else "")
        print(f"{report.store}: {report.vectors_indexed} vectors indexed with {report.backend_id} "
              f"({report.donors_embedded} prompts embedded{dropped}, {report.donors_removed} stale prompt "
              f"records removed) in {report.seconds:.1f} s", flush=True)
    return 0
