"""``python -m edgesync_store.compact [STORE] [--dry-run] [--check] [--json] [--max-bytes 512M] [--no-reclaim]
[--force-reclaim] [--reclaim-fraction 0.25]`` (also ``edgesync compact``): compact a store once
(``compactor.py``) and print what it did, before and after (``--json``: one object,
``CompactionReport.to_dict``). It reads ``StoreSettings`` alone (no engine): STORE defaults to
``store_path``; the budget is ``--max-bytes``, else ``EDGESYNC_MAX_BYTES``, else the store's
recorded one. An older store format is migrated; ``--dry-run`` opens read-only.

Ctrl-C or SIGTERM stops between steps (each commits whole): the report so far, exit 130. Exit
status otherwise: 0 done (or skipped: another process compacts), 1 a damaged store, 2 bad
input (one ``error: ...`` line on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from edgesync_store.commands.units import format_binary as fmt
from edgesync_store.commands.units import parse_bytes
from edgesync_store.errors import StoreDamagedError, StoreError
from edgesync_store.settings import LOG_LEVELS, StoreSettings

DESCRIPTION = "Expire, deduplicate, merge, evict and reclaim an EdgeSync store once."
EXIT_STOPPED = 130
"""Exit status when Ctrl-C or SIGTERM stopped the run between steps."""
EXIT_USAGE = 2
"""Exit status for bad input: no store at the path, not a store, a bad option or setting."""
EXIT_DAMAGED = 1
"""Exit status when the store is damaged (``--check``, or a compaction refused)."""


class BadInput(Exception):
    """Bad input, reported as one ``error: <message>`` line on stderr and :data:`EXIT_USAGE`."""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments, on ``parser``."""
    parser.add_argument("store", nargs="?", help="store directory (default: the configured store)")
    parser.add_argument("--dry-run", action="store_true", help="report what would be done; change nothing")
    parser.add_argument("--check", action="store_true",
                        help="only check the store's LMDB pages (exit 0 healthy, 1 damaged); change nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--max-bytes", type=parse_bytes, default=None,
                        help="size budget for eviction (default: the store's recorded budget, else 1 GiB)")
    reclaim = parser.add_mutually_exclusive_group()
    reclaim.add_argument("--no-reclaim", action="store_true", help="do not rewrite the file to return free pages")
    reclaim.add_argument("--force-reclaim", action="store_true", help="rewrite the file whenever any page is free")
    parser.add_argument("--reclaim-fraction", type=_fraction, default=None,
                        help="free fraction of data.mdb that triggers the rewrite (default 0.25)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m edgesync_store.compact``."""
    parser = argparse.ArgumentParser(prog="python -m edgesync_store.compact", description=DESCRIPTION)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default="WARNING", help="logging level (default WARNING)")
    add_arguments(parser)
    return parser


def add_parser(sub, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``compact`` on ``sub`` (the subparsers of the ``edgesync`` command line); ``common``
    is the parent parser holding its shared options. ``args.func`` is :func:`run_command`, which
    reports bad input itself. Returns the new parser."""
    p = sub.add_parser("compact", parents=[common], description=DESCRIPTION,
                       help="expire, deduplicate, merge, evict and reclaim a store once")
    add_arguments(p)
    p.set_defaults(func=run_command)
    return p


def render(report: dict, path: Path) -> str:
    """The human-readable summary of a report (plain text, one fact per line)."""
    if report["skipped"]:
        return f"{path}: skipped: {report['skipped']}"
    rec = report["reclaim"] or {}
    lines = [
        f"store {path}" + (" (dry run: nothing changed)" if report["dry_run"] else ""),
        f"  expired        {report['expired']:>8} fragments  {fmt(report['expired_bytes'])}",
        f"  deduplicated   {report['deduplicated']:>8} fragments  {fmt(report['deduplicated_bytes'])}",
        f"  merged         {report['fragments_merged']:>8} fragments into "
        f"{report['merged_layers'] + report['merged_heads']}"
        f" ({report['merged_layers']} along layers, {report['merged_heads']} along heads)",
        f"  evicted        {report['evicted']:>8} fragments  {fmt(report['evicted_bytes'])}"
        f"  (budget {fmt(report['max_bytes'])})",
        f"  reclaimed      {fmt(report['bytes_reclaimed'])}"
        + (f"  ({rec.get('reason')})" if rec.get("reason") and not rec.get("reclaimed") else ""),
    ]
    if report["dry_run"]:
        lines += [
            f"  fragments      {report['fragments_before']} (unchanged: dry run)",
            f"  stored bytes   {fmt(report['used_bytes_before'])} (unchanged: dry run)",
            f"  bytes on disk  {fmt(report['disk_bytes_before'])} (unchanged: dry run)",
        ]
    else:
        lines += [
            f"  fragments      {report['fragments_before']} -> {report['fragments_after']}",
            f"  stored bytes   {fmt(report['used_bytes_before'])} -> {fmt(report['used_bytes_after'])}",
            f"  bytes on disk  {fmt(report['disk_bytes_before'])} -> {fmt(report['disk_bytes_after'])}",
        ]
    lines.append(f"  took           {report['elapsed_s']:.2f} s"
                 + (" (stopped early: the store is consistent; run again to finish)" if report["stopped"] else ""))
    return "\n".join(lines)


def _open_store(args: argparse.Namespace):
    """``(store, path, budget from EDGESYNC_MAX_BYTES or None)``; BadInput for bad input."""
    from edgesync_store.core.store import FragmentStore
    from edgesync_store.migrations import migrate

    try:
        settings = StoreSettings.load()
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    path = Path(args.store).expanduser() if args.store else settings.store_path
    if not (path / "data.mdb").is_file():
        raise BadInput(f"no EdgeSync store at {path}")
    try:
        store = FragmentStore(path, readonly=args.dry_run, compression=settings.compression, upgrade=migrate)
    except StoreDamagedError:
        raise  # never written into: run_command reports it with EXIT_DAMAGED
    except (StoreError, OSError) as exc:
        raise BadInput(str(exc)) from None
    return store, path, settings.max_bytes


def _run(store, args: argparse.Namespace, env_budget: int | None, stop: threading.Event):
    """One ``Compactor`` run, with a progress bar when stderr is a terminal; its report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from edgesync_store.compactor import Compactor, open_index

    with store, Progress(TextColumn("{task.description:<13}"), BarColumn(), MofNCompleteColumn(),
                         transient=True, disable=not sys.stderr.isatty()) as bar:
        tasks: dict[str, int] = {}

        def progress(step: str, done: int, total: int) -> None:
            if step not in tasks:
                tasks[step] = bar.add_task(step, total=total)
            bar.update(tasks[step], completed=done, total=total)

        index = None if args.dry_run else open_index(store)
        try:
            kwargs = {} if args.reclaim_fraction is None else {"reclaim_fraction": args.reclaim_fraction}
            return Compactor(store, index=index, stop=stop, progress=progress).run(
                dry_run=args.dry_run, do_reclaim=not args.no_reclaim,
                max_bytes=args.max_bytes or env_budget, force_reclaim=args.force_reclaim, **kwargs)
        finally:
            if index is not None:
                index.close()


def cmd_compact(args: argparse.Namespace) -> int:
    """Run the command on parsed ``args``; the exit status (0, or 130 when stopped). Raises
    BadInput for no store at the path, not a store, a newer format or a bad setting."""
    if args.check:
        return _check(args)
    store, path, env_budget = _open_store(args)
    stop = threading.Event()
    signalled: list[int] = []

    def on_signal(signum, _frame) -> None:  # stop between steps; a second signal stops at once
        if signalled:
            raise KeyboardInterrupt
        signalled.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        report = _run(store, args, env_budget, stop)
    except KeyboardInterrupt:
        print("interrupted: every finished step is committed and the store is consistent; "
              "run the command again to finish", file=sys.stderr)
        return EXIT_STOPPED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    doc = report.to_dict()
    doc["store"] = str(path)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render(doc, path))
    return EXIT_STOPPED if signalled else 0


def _check(args: argparse.Namespace) -> int:
    """``--check``: the page check, printed like ``edgesync check``; :data:`EXIT_DAMAGED` when damaged."""
    from edgesync_store.core import page_check as check
    from edgesync_store.core.check import has_data_file

    try:
        path = Path(args.store).expanduser() if args.store else StoreSettings.load().store_path
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if not has_data_file(path):
        raise BadInput(f"no EdgeSync store at {path}")
    report = check.verify(path)
    doc = {"store": str(path), **report.to_dict()}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{path}: healthy" if report.healthy else f"{path}: damaged: {report.damage}; "
              f"`edgesync clear {path} --yes` erases and recreates it (it is a cache)")
    return 0 if report.healthy else EXIT_DAMAGED


def run_command(args: argparse.Namespace) -> int:
    """:func:`cmd_compact`, with bad input reported as one ``error: ...`` line on stderr and
    :data:`EXIT_USAGE`, a damaged store (never compacted) likewise with :data:`EXIT_DAMAGED`;
    returns the exit status."""
    try:
        return cmd_compact(args)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except StoreDamagedError as exc:
        print(f"error: not compacting a damaged store: {exc}", file=sys.stderr, flush=True)
        return EXIT_DAMAGED
    except PermissionError as exc:
        print(f"error: store path {args.store or 'of the settings'}: cannot be read ({exc.strerror or exc})",
              file=sys.stderr, flush=True)
        return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """``python -m edgesync_store.compact``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    return run_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
