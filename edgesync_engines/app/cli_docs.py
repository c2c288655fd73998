"""The ``edgesync docs`` subcommands: ``add``, ``list`` and ``remove``, on the configured model's
documents in a store. ``add`` reads and tokenizes every document before any KV is computed, so
bad input refuses the whole command with nothing stored
(:class:`~edgesync_engines.app.cli_common.CommandError`, exit 2)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from edgesync_engines.app.cli_common import CommandError, load_config, open_edgesync, progress_bar
from edgesync_engines.app.cli_model import STORE_HELP, add_model_options
from edgesync_engines.app.doc_files import DocumentFileError, read_documents
from edgesync_engines.request.documents import DocumentInput
from edgesync_store.commands.inventory import iso_time, wide_console
from edgesync_store.commands.units import format_bytes
from edgesync_store.errors import MissingExtraError, StoreError
from edgesync_store.schema import chunk_spans

ID_PREFIX_CHARS = 12
"""Hex digits of a document ID that ``docs list`` shows."""
MIN_ID_PREFIX = 8
"""Fewest hex digits ``docs remove`` accepts for an ID prefix."""
_DOC_INDEX = re.compile(r"^documents\[\d+\]: ")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help=STORE_HELP)
    add_model_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary or table")


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """Register ``docs add|list|remove`` on ``sub`` (the subparsers of ``cli.build_parser``);
    ``common`` is the parent parser holding ``--log-level``."""
    docs = sub.add_parser("docs", parents=[common],
                          help="add, list and remove documents (KV computed once, reused at any position)")
    actions = docs.add_subparsers(dest="docs_command", metavar="ACTION", required=True)
    add = actions.add_parser("add", parents=[common],
                             help="store documents from .jsonl files and directories of .txt/.md files")
    add.add_argument("paths", nargs="+", metavar="FILE.jsonl|DIR",
                     help="a JSON Lines file (one object with text or context per line), a .txt/.md file, "
                          "or a directory (its *.txt and *.md files, recursively)")
    _add_common(add)
    add.set_defaults(func=cmd_add)
    lst = actions.add_parser("list", parents=[common], help="the stored documents of the model")
    _add_common(lst)
    lst.set_defaults(func=cmd_list)
    remove = actions.add_parser("remove", parents=[common], help="remove documents and their fragments")
    remove.add_argument("ids", nargs="*", metavar="ID",
                        help=f"a document ID or a unique prefix of at least {MIN_ID_PREFIX} hex digits")
    remove.add_argument("--all", action="store_true", help="remove every stored document of the model")
    _add_common(remove)
    remove.set_defaults(func=cmd_remove)


def _open(args: argparse.Namespace, must_exist: bool):
    """The EdgeSync of the command's options; CommandError when ``must_exist`` and there is
    no store yet (listing or removing must not create one)."""
    cfg = load_config({"store_path": args.store, "model_path": args.model, "kv_type": args.kv_type,
                       "engine": args.engine})
    if not cfg.cache_enabled:
        raise CommandError("documents need the fragment store, which is off (EDGESYNC_CACHE=0)")
    if must_exist:
        from edgesync_store.commands.clear import check_store_path
        from edgesync_store.errors import StoreOpenError

        try:
            check_store_path(cfg.store_path)
        except (FileNotFoundError, StoreOpenError) as exc:
            raise CommandError(str(exc)) from None
    _refuse_damaged(Path(cfg.store_path))
    es = open_edgesync(cfg)
    if es.store is None or es.adapter.namespace is None:
        reason = es.uncached_reason or "no store"
        es.close()
        raise CommandError(f"documents cannot be stored for this engine: {reason}")
    return es


def _refuse_damaged(path: Path) -> None:
    """CommandError naming the store and ``edgesync clear`` when its pages are damaged: nothing
    is written into it (a request is served uncached from such a store; a command refuses)."""
    from edgesync_store.core import page_check as check
    from edgesync_store.core.check import opened_as_store
    from edgesync_store.errors import StoreDamagedError

    report = check.verify(path)  # a passed check is remembered: the open below does not repeat it
    if not report.healthy and not opened_as_store(path):
        raise CommandError(f"no EdgeSync store at {path}: its data.mdb is not one ({report.damage})")
    if not report.healthy:
        raise CommandError(f"not writing into a damaged store: {StoreDamagedError(path, report.damage)}")


def kv_state(es, rec) -> bool | None:
    """True when the store holds ``rec``'s whole chain, False when some of it is gone, None for
    a document too short for one fragment (it is recomputed whenever it is used)."""
    if not chunk_spans(len(rec.chain), es.config.chunk_tokens):
        return None
    return bool(es.documents.kv_stored(rec))


def _store_totals(es) -> tuple[int, int]:
    stats = es.store.stats()
    return stats.fragments, stats.compressed_bytes


# -- add ----------------------------------------------------------------------------------------

def _validate(es, sources) -> list[tuple[Any, Any]]:
    """``(source, record)`` per document, tokenized now; CommandError naming the first bad one."""
    out = []
    for src in sources:
        doc = src.document
        try:
            rec = es.documents.record_for(DocumentInput(doc["text"], doc["title"], doc["source"]))
        except ValueError as exc:
            raise CommandError(f"{src.origin}: {_DOC_INDEX.sub('', str(exc))}") from None
        out.append((src, rec))
    return out


def _plan(es, checked) -> tuple[list, list, int]:
    """Split validated documents into (to add, already stored, duplicates within the input)."""
    stored = {r.key for r in es.list_documents()}
    seen: set[bytes] = set()
    to_add, already, duplicates = [], [], 0
    for src, rec in checked:
        if rec.key in seen:
            duplicates += 1
            continue
        seen.add(rec.key)
        (already if rec.key in stored and kv_state(es, rec) is not False else to_add).append((src, rec))
    return to_add, already, duplicates


def _store(es, to_add, quiet: bool) -> list:
    docs = [src.document for src, _ in to_add]
    with progress_bar(disable=quiet or not docs) as bar:
        task = bar.add_task("documents", total=len(docs))
        try:
            return es.add_documents(docs, progress=lambda i: bar.update(task, completed=i))
        except (PermissionError, MissingExtraError) as exc:
            raise CommandError(str(exc)) from None
        except (ValueError, StoreError) as exc:
            raise CommandError(f"cannot add documents to {es.store.path}: {exc}") from None


def cmd_add(args: argparse.Namespace) -> int:
    """``edgesync docs add``: read, validate (all before any KV), store; the summary on stdout."""
    try:
        found = read_documents(args.paths)
    except DocumentFileError as exc:
        raise CommandError(str(exc)) from None
    for path, reason in found.skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with _open(args, must_exist=False) as es:
        to_add, already, duplicates = _plan(es, _validate(es, found.documents))
        fragments0, bytes0 = _store_totals(es)
        added = _store(es, to_add, quiet=args.json)
        fragments1, bytes1 = _store_totals(es)
        store_path = str(es.store.path)
    status = {rec.key: "added" for rec in added}
    rows = [(rec, status.get(rec.key, "stored")) for rec in added + [r for _, r in already]]
    doc = {
        "store": store_path,
        "added": len(added),
        "already_stored": len(already),
        "duplicates": duplicates,
        "skipped": [{"path": p, "reason": r} for p, r in found.skipped],
        "tokens": sum(len(rec.tokens) for rec in added),
        "fragments_written": max(0, fragments1 - fragments0),
        "bytes_written": max(0, bytes1 - bytes0),
        "seconds": round(time.perf_counter() - t0, 2),
        "documents": [{"id": rec.doc_id, "title": rec.title, "source": rec.source, "tokens": len(rec.tokens),
                       "status": state} for rec, state in rows],
    }
    if args.json:
        print(json.dumps(doc), flush=True)
        return 0
    print(f"{store_path}: {doc['added']} documents added, {doc['already_stored']} already stored"
          + (f", {duplicates} duplicates in the input" if duplicates else "")
          + (f", {len(found.skipped)} files skipped" if found.skipped else "")
          + f"; {doc['tokens']} tokens prefilled, {doc['fragments_written']} fragments "
          f"({format_bytes(doc['bytes_written'])}) written in {doc['seconds']:.1f} s", flush=True)
    return 0


# -- list ---------------------------------------------------------------------------------------

def document_rows(es) -> list[dict]:
    """One JSON-able row per stored document of ``es``'s model, oldest first."""
    rows = []
    for rec in sorted(es.list_documents(), key=lambda r: (r.added_at, r.doc_id)):
        rows.append({"id": rec.doc_id, "title": rec.title, "source": rec.source, "tokens": len(rec.tokens),
                     "header_tokens": len(rec.header), "windows": len(rec.vectors),
                     "kv_stored": kv_state(es, rec), "added_at": rec.added_at, "added": iso_time(rec.added_at)})
    return rows


def cmd_list(args: argparse.Namespace) -> int:
    """``edgesync docs list``: a table (or ``--json``) of the stored documents."""
    from rich.table import Table

    with _open(args, must_exist=True) as es:
        rows = document_rows(es)
        store_path, model = str(es.store.path), es.adapter.model_path.name
    if args.json:
        print(json.dumps({"store": store_path, "model": model, "count": len(rows), "documents": rows}), flush=True)
        return 0
    table = Table(title=f"{len(rows)} documents of {model} in {store_path}",
                  caption="KV stored: yes, no (recomputed and stored again when next used), "
                          "- (under one fragment: recomputed whenever used)")
    for name, justify in (("id", "left"), ("title", "left"), ("source", "left"), ("tokens", "right"),
                          ("KV stored", "left"), ("added", "left")):
        table.add_column(name, justify=justify, no_wrap=name in ("id", "added"))
    for row in rows:
        kv = {True: "yes", False: "no", None: "-"}[row["kv_stored"]]
        table.add_row(row["id"][:ID_PREFIX_CHARS], row["title"] or "-", row["source"] or "-", str(row["tokens"]),
                      kv, row["added"] or "-")
    wide_console().print(table)
    return 0


# -- remove -------------------------------------------------------------------------------------

def _resolve(records, given: str):
    """The one record whose ID is or starts with ``given``; CommandError otherwise."""
    prefix = given.strip().lower()
    if not re.fullmatch(f"[0-9a-f]{{{MIN_ID_PREFIX},64}}", prefix):
        raise CommandError(f"{given!r}: a document ID is {MIN_ID_PREFIX} to 64 hex digits "
                           "(see `edgesync docs list`)")
    found = [r for r in records if r.doc_id.startswith(prefix)]
    if not found:
        raise CommandError(f"no stored document {given}")
    if len(found) > 1:
        raise CommandError(f"{given}: the prefix names {len(found)} documents; give more digits")
    return found[0]


def cmd_remove(args: argparse.Namespace) -> int:
    """``edgesync docs remove ID... | --all``: every ID resolved before anything is removed."""
    if args.all == bool(args.ids):
        raise CommandError("docs remove: give document IDs or --all (not both)")
    with _open(args, must_exist=True) as es:
        stored = es.list_documents()
        chosen = stored if args.all else list({r.key: r for r in (_resolve(stored, i) for i in args.ids)}.values())
        fragments0, bytes0 = _store_totals(es)
        try:
            removed = es.remove_documents(chosen)
        except (KeyError, StoreError) as exc:
            raise CommandError(f"cannot remove documents from {es.store.path}: {exc}") from None
        fragments1, bytes1 = _store_totals(es)
        doc = {"store": str(es.store.path), "removed": removed, "ids": [r.doc_id for r in chosen],
               "fragments_removed": max(0, fragments0 - fragments1), "bytes_freed": max(0, bytes0 - bytes1),
               "remaining": len(stored) - removed}
    if args.json:
        print(json.dumps(doc), flush=True)
    else:
        print(f"{doc['store']}: {removed} documents removed ({doc['fragments_removed']} fragments, "
              f"{format_bytes(doc['bytes_freed'])}); {doc['remaining']} left", flush=True)
    return 0
