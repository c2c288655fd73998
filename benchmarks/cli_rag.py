"""``edgesync fidelity --workload rag`` and ``edgesync bench --workloads rag``: the rag
measurement of :mod:`edgesync_bench.rag_fidelity` run once, in this process, on a fresh
store in a temporary directory; a rich table on stdout (or JSON), a PNG plot of quality against
TTFT, progress bars on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from edgesync_bench import rag_fidelity
from edgesync_engines.app.cli_common import CommandError, open_edgesync, progress_bar, write_json_out


def shares_arg(text: str) -> list[float]:
    """argparse type: ``"0,0.05,0.15"`` -> sorted distinct shares in [0, 1]."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"shares must be in [0, 1], got {text!r}")
    return sorted(set(values))


def measure(cfg, limit: int | None, shares, curve_limit: int | None, max_tokens: int,
            show_progress: bool = True) -> dict:
    """Run :func:`rag_fidelity.run_rag` on the first ``limit`` requests (None: all 200) with a
    fresh store in a temporary directory (removed afterwards); returns its report.

    Raises:
        CommandError: missing workload data or model, or a failure of the store or a request.
    """
    from edgesync_bench.rag_workload import RAG_REQUESTS, rag_corpus, rag_workload
    from edgesync_bench.workloads import WorkloadDataError

    try:
        requests = rag_workload(limit or RAG_REQUESTS)
        corpus = rag_corpus()
    except WorkloadDataError as exc:
        raise CommandError(str(exc)) from None
    labels = {"corpus": "adding the corpus (documents)", "requests": "rag requests"}
    with tempfile.TemporaryDirectory(prefix="edgesync-rag-") as tmp, \
            progress_bar(disable=not show_progress) as bar:
        tasks: dict[str, Any] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(labels.get(stage, stage), total=total)
            bar.update(tasks[stage], completed=done, total=total)

        # documents and the exact prefixes outlive the run: nothing may expire mid-run
        run_cfg = dataclasses.replace(cfg, store_path=Path(tmp) / "store", ttl_seconds=1e9)
        with open_edgesync(run_cfg) as es:
            try:
                return rag_fidelity.run_rag(es, requests, corpus, shares=shares, curve_limit=curve_limit,
                                            max_tokens=max_tokens, progress=report)
            except (ValueError, RuntimeError, OSError) as exc:
                raise CommandError(f"rag: {exc}") from None


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render_table(doc: dict):
    """A rich Table of a :func:`rag_fidelity.run_rag` report: one line per system and share."""
    from rich.table import Table

    s = doc["settings"]
    table = Table(title=f"rag workload, {doc['model']}: {s['requests']} requests ({s['curve_requests']} for the "
                        f"curve's other shares), {s['max_tokens']} greedy tokens, default share {s['default_share']:g}")
    for name in ("system", "n", "TTFT mean ms", "p50 ms", "vs full", "vs prefix-only", "identical", "ROUGE-L",
                 "F1", "EM", "F1 - full", "reused", "recomputed"):
        table.add_column(name, justify="left" if name == "system" else "right")
    for r in doc["systems"]:
        table.add_row(r["label"], str(r["n"]), _num(r["ttft_mean_ms"], ".0f"), _num(r["ttft_p50_ms"], ".0f"),
                      _num(r["ttft_vs_full"], ".3f"), _num(r["ttft_vs_prefix"], ".3f"),
                      f"{r['identical']}/{r['n']}", _num(r["rouge_l"], ".3f"), _num(r["f1"], ".3f"),
                      _num(r["em"], ".3f"), _num(r["f1_delta"], "+.3f"), _num(r["tokens_reused_mean"], ".0f"),
                      _num(r["recomputed_tokens_mean"], ".0f"))
    c, ret = doc["corpus"], doc["retrieval"]
    recall = ", ".join(f"{k} {v:.3f}" for k, v in ret.items() if k.startswith("recall@"))
    table.caption = (f"n = requests each row ran (ratios, identical, ROUGE-L and F1 - full against full prefill / "
                     f"prefix-only on the same requests); noise floor = full prefill with flash attention on; "
                     f"reused / recomputed = mean tokens per request. Corpus: {c['documents']} documents "
                     f"({c['document_tokens']} tokens) added in {c['add_s']:.1f} s, "
                     f"store {c['store_bytes'] / 1e6:.1f} MB. "
                     f"Retrieval on {ret['n']} questions: {recall}. Requests {doc['timings_s']['requests']:.0f} s.")
    return table


def plot(doc: dict, path: str | Path) -> Path:
    """The quality-against-TTFT PNG of a report (``edgesync_bench.plots.quality_vs_ttft``).

    Raises:
        CommandError: matplotlib is not installed (the ``bench`` extra).
    """
    try:
        from edgesync_bench.plots import quality_vs_ttft

        s = doc["settings"]
        return quality_vs_ttft(doc["systems"], path,
                               title=f"rag: quality vs TTFT by recompute share ({doc['model']}, "
                                     f"{s['requests']} requests; curve on {s['curve_requests']})")
    except ImportError as exc:
        raise CommandError(f"--plot: {exc}") from None


def emit(doc: dict, json_stdout: bool, json_out: str | None, plot_path: str | None) -> None:
    """Write the report: ``json_out`` and ``plot_path`` when given, then JSON or the table on stdout."""
    text = json.dumps(doc, indent=2)
    write_json_out(json_out, text)
    if plot_path:
        plot(doc, plot_path)
    if json_stdout:
        print(text, flush=True)
    else:
        from edgesync_store.commands.inventory import wide_console

        wide_console().print(render_table(doc))


def cmd_fidelity_rag(args: argparse.Namespace, cfg) -> int:
    """``edgesync fidelity --workload rag``; returns 0. Raises CommandError on bad input."""
    if args.plot and not str(args.plot).lower().endswith(".png"):
        raise CommandError(f"--plot {args.plot}: expected a .png file")
    doc = measure(cfg, args.limit, args.shares, args.curve_limit, args.max_tokens)
    emit(doc, args.json, args.json_out, args.plot)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """``edgesync bench --workloads rag [--limit N] [--curve-limit N]``: the same measurement,
    written to ``--out`` (default ``results/bench-<UTC time>/``: ``rag.json``, ``rag.png``) and
    ``--json``; the table on stdout. Returns 0. Raises CommandError on bad input."""
    from edgesync_engines.app.cli_common import load_config

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"--out {out}: exists and is not an empty directory; choose a new directory")
    cfg = load_config({} if args.threads is None else {"n_threads": args.threads})
    if args.model is not None:
        cfg = dataclasses.replace(cfg, model_path=args.model)
    doc = measure(cfg, args.limit, rag_fidelity.DEFAULT_SHARES, args.curve_limit, rag_fidelity.DEFAULT_MAX_TOKENS,
                  show_progress=not args.no_progress)
    out.mkdir(parents=True, exist_ok=True)
    emit(doc, False, str(out / "rag.json"), str(out / "rag.png"))
    if args.json:
        write_json_out(str(args.json), json.dumps(doc, indent=2))
    print(f"report: {out / 'rag.json'}  plot: {out / 'rag.png'}", flush=True)
    return 0
