"""``edgesync run WORKLOAD``: a workload run uncached and through EdgeSync, request by request, and
compared (the table of :mod:`edgesync_bench.run_report`). ``make demo`` runs it twice on one store.

Results go to stdout; progress and summaries to stderr; bad input raises
:class:`~edgesync_engines.app.cli_common.CommandError` (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os

from edgesync_bench import run_report
from edgesync_bench.workloads import WORKLOAD_NAMES, WorkloadDataError, load_workload
from edgesync_engines.app.cli_common import (
    CommandError,
    check_writable,
    load_config,
    open_edgesync,
    positive_int,
    progress_bar,
    write_json_out,
)
from edgesync_engines.app.cli_model import STORE_HELP, add_engine_options
from edgesync_store.commands.inventory import wide_console

RUN_MAX_TOKENS = 16
"""``edgesync run``'s generation length when neither --max-tokens nor EDGESYNC_MAX_TOKENS is set."""


def workload_name(text: str) -> str:
    """An argparse type: ``doc_qa`` or ``Doc-QA`` -> ``doc-qa``."""
    return text.strip().lower().replace("_", "-")


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """Register ``run`` on ``sub`` (the subparsers of ``edgesync_engines.app.cli.build_parser``);
    ``common`` is the parent parser holding ``--log-level``."""
    run = sub.add_parser("run", parents=[common],
                         help="run a workload uncached and through EdgeSync, request by request, and compare")
    run.add_argument("workload", type=workload_name, choices=WORKLOAD_NAMES, metavar="WORKLOAD",
                     help=f"one of: {', '.join(WORKLOAD_NAMES)}")
    run.add_argument("--limit", type=positive_int, help="run only the first N requests")
    run.add_argument("--store", help=STORE_HELP)
    run.add_argument("--max-tokens", type=int,
                     help="tokens to generate per request (default 16, or EDGESYNC_MAX_TOKENS)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    run.add_argument("--json-out", metavar="FILE", help="also write the JSON object to FILE")
    add_engine_options(run)
    run.set_defaults(func=cmd_run)


def run_workload(es, requests, max_tokens: int, progress=None, task=None) -> list[dict]:
    """Each request once uncached (same adapter, no store: a cleared KV cache every time) and
    then once through ``es``, interleaved request by request; returns the per-request records
    (:func:`run_report.request_record`). ``progress``/``task``: a rich Progress and its task,
    advanced once per request."""
    from edgesync_engines.request.router import EdgeSync

    baseline = EdgeSync(es.adapter, store=False, config=es.config)
    records = []
    for req in requests:
        messages = req.as_messages()
        uncached = baseline.generate(messages, max_tokens=max_tokens)
        cached = es.generate(messages, max_tokens=max_tokens)
        records.append(run_report.request_record(req, uncached, cached))
        if progress is not None:
            progress.update(task, advance=1, description=f"{req.request_id} {cached.hit:>7}")
    return records


def _run_with_progress(es, requests, workload: str, max_tokens: int) -> list[dict]:
    with progress_bar() as progress:
        task = progress.add_task(f"{workload}", total=len(requests))
        try:
            return run_workload(es, requests, max_tokens, progress, task)
        except ValueError as exc:  # a request that does not fit the context
            raise CommandError(str(exc)) from None


def cmd_run(args: argparse.Namespace) -> int:
    """``edgesync run WORKLOAD``: the comparison table (or ``--json`` document) on stdout."""
    if args.max_tokens is None and not os.environ.get("EDGESYNC_MAX_TOKENS", "").strip():
        args.max_tokens = RUN_MAX_TOKENS
    cfg = load_config({"store_path": args.store, "max_tokens": args.max_tokens, "reuse": args.reuse,
                       "engine": args.engine, "allow_convertible": args.allow_convertible,
                       "model_path": args.model, "kv_type": args.kv_type})
    args.max_tokens = cfg.max_tokens
    check_writable(args.json_out)
    try:
        requests = load_workload(args.workload, limit=args.limit)
    except (WorkloadDataError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    with open_edgesync(cfg) as es:
        records = _run_with_progress(es, requests, args.workload, args.max_tokens)
        stats = es.store.stats().to_dict() if es.store is not None else None
        model = es.adapter.model_path.name
        uncached_reason = es.uncached_reason
    summary = run_report.summarize(records)
    doc = {
        "workload": args.workload,
        "n_requests": len(records),
        "max_tokens": args.max_tokens,
        "model": model,
        "engine": cfg.engine,
        "allow_convertible": cfg.allow_convertible,
        "store_path": str(cfg.store_path) if stats is not None else None,
        "uncached_reason": uncached_reason,
        "summary": summary,
        "store": stats,
        "requests": run_report.request_rows(records),
    }
    text = json.dumps(doc, indent=2)
    write_json_out(args.json_out, text)
    if args.json:
        print(text, flush=True)
    else:
        title = (f"workload {args.workload}: {len(records)} requests, "
                 f"store {doc['store_path'] or 'disabled'}, model {model}, engine {cfg.engine}"
                 + (" (convertible KV allowed)" if cfg.allow_convertible else ""))
        wide_console().print(run_report.render_table(summary, stats, title, uncached_reason))
    return 0


