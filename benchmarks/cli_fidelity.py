"""``edgesync fidelity``: how often the approximate mode serves a paraphrase's KV, and how the
answers compare (computation in :mod:`edgesync_bench.fidelity`); with ``--workload rag``,
documents reuse by recompute share against full prefill (:mod:`edgesync_bench.cli_rag`).

Prints a table (or, with ``--json``, one JSON object) to stdout; progress bars and errors go to
stderr. Bad input (missing data, a bad option, a missing package or model) exits 2.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from edgesync_bench import cli_rag, fidelity, fidelity_vectors, rag_fidelity, workloads
from edgesync_engines.app.cli_common import (
    CommandError,
    check_writable,
    int_at_least,
    load_config,
    open_edgesync,
    positive_int,
    progress_bar,
    write_json_out,
)
from edgesync_engines.config import ENGINES

_count = int_at_least(0)


def _thresholds(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"thresholds must be in (0, 1], got {text!r}")
    return sorted(set(values))


def add_parser(sub, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``fidelity`` subcommand on ``sub`` (the subparsers of ``cli.build_parser``);
    ``common`` is the parent parser holding ``--log-level``. Returns the new parser."""
    p = sub.add_parser(
        "fidelity", parents=[common],
        help="measure the approximate mode on labelled question pairs: shares served, answer agreement",
        description="For each threshold: the shares of duplicate and non-duplicate pairs of "
                    f"{fidelity.PAIRS_FILE} whose similarity would make the approximate mode serve them as "
                    "exact hits, and, on a sample of those hits run through the model, how often the "
                    "approximate answer's greedy tokens equal the uncached answer's (and their ROUGE-L).")
    p.add_argument("--pairs", metavar="FILE",
                   help=f"labelled pairs, JSON Lines {{a, b, duplicate}} (default: {fidelity.PAIRS_FILE} "
                        "of the workloads directory)")
    p.add_argument("--sample", type=_count, default=fidelity.DEFAULT_SAMPLE, metavar="N",
                   help=f"served pairs per threshold run through the model (default {fidelity.DEFAULT_SAMPLE}; "
                        "0: shares only, no model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample draw (default 0)")
    p.add_argument("--max-tokens", type=positive_int, default=fidelity.DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"tokens generated per answer (default {fidelity.DEFAULT_MAX_TOKENS})")
    p.add_argument("--thresholds", type=_thresholds, default=list(fidelity.DEFAULT_THRESHOLDS), metavar="T,T,...",
                   help="similarity thresholds (default 0.75,0.8,0.85,0.9,0.95)")
    p.add_argument("--topic", type=_count, default=0, metavar="N",
                   help="entry of system_prompts.json used as the system prompt of every request (default 0)")
    p.add_argument("--no-vector-cache", action="store_true",
                   help="embed every question again instead of reusing the vectors of an earlier run "
                        f"(kept in {fidelity_vectors.default_vector_cache_dir()})")
    p.add_argument("--engine", type=str.lower, choices=ENGINES,
                   help="llamacpp (default) or onnx (ONNX Runtime on the export of the same GGUF)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--json-out", metavar="FILE", help="also write the JSON object to FILE")
    rag = p.add_argument_group("--workload rag")
    rag.add_argument("--workload", choices=("pairs", "rag"), default="pairs",
                     help="pairs: the approximate mode on labelled pairs (default); rag: documents reuse "
                          "(full prefill, prefix-only, blend by recompute share, flash-attention noise floor)")
    rag.add_argument("--limit", type=positive_int, default=None, metavar="N",
                     help="rag: first N requests (default 200)")
    rag.add_argument("--shares", type=cli_rag.shares_arg, default=list(rag_fidelity.DEFAULT_SHARES),
                     metavar="S,S,...",
                     help="rag: recompute shares of blend (default 0,0.05,0.15,0.3,1; the configured "
                          "blend_recompute is always measured)")
    rag.add_argument("--curve-limit", type=positive_int, default=None, metavar="N",
                     help="rag: shares other than the default on the first N requests only (default: all)")
    rag.add_argument("--plot", metavar="FILE.png", help="rag: write the quality-against-TTFT plot to FILE.png")
    p.set_defaults(func=cmd_fidelity)
    return p


def report_dict(shares: list[fidelity.ShareRow], samples: list[fidelity.ThresholdSample],
                records: list[fidelity.SampleRecord], **meta) -> dict:
    """The JSON document: ``meta`` keys first, then ``thresholds`` (one object per threshold
    with the share and sample fields) and ``samples`` (the records)."""
    by_t = {s.threshold: asdict(s) for s in samples}
    rows = [{**asdict(r), "sample": by_t.get(r.threshold)} for r in shares]
    return {**meta, "thresholds": rows, "samples": [asdict(r) for r in records]}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render_table(doc: dict[str, Any]):
    """A rich Table of a :func:`report_dict` document (one line per threshold)."""
    from rich.table import Table

    s = doc["sample_settings"]
    table = Table(title=f"approximate mode on {doc['n_pairs']} pairs ({doc['n_dup']} duplicates) of "
                        f"{Path(doc['pairs_file']).name}; sample: {s['max_tokens']} greedy tokens, "
                        f"{s['model'] or 'no model'}, system prompt {s['app']!r}")
    for name in ("threshold", "dup served", "non-dup served", "precision", "sample n", "identical greedy",
                 "mean ROUGE-L"):
        table.add_column(name, justify="right")
    for row in doc["thresholds"]:
        smp = row["sample"]
        if smp is None or smp["n"] == 0:
            n, same, rouge = "0", "-", "-"
        else:
            n = str(smp["served"]) if smp["served"] == smp["n"] else f"{smp['served']} of {smp['n']} served"
            same = ("-" if smp["identical_share"] is None
                    else f"{smp['identical']}/{smp['served']} ({_pct(smp['identical_share'])})")
            rouge = "-" if smp["mean_rouge_l"] is None else f"{smp['mean_rouge_l']:.3f}"
        table.add_row(f"{row['threshold']:.2f}", f"{_pct(row['dup_share'])} ({row['dup_served']})",
                      f"{_pct(row['nondup_share'])} ({row['nondup_served']})",
                      "-" if row["precision"] is None else f"{row['precision']:.3f}", n, same, rouge)
    t = doc["timings_s"]
    table.caption = (f"served = similarity >= threshold ({doc['embedding']}); precision = duplicates / served; "
                     f"identical greedy and ROUGE-L over the sampled pairs the router served approximately; "
                     f"embed {t['embed']:.0f} s, sample {t['sample']:.0f} s")
    return table


def cmd_fidelity(args: argparse.Namespace) -> int:
    """Run ``edgesync fidelity``; returns the exit status (0, or 2 on bad input).

    Raises:
        CommandError: missing data, a bad option, a missing package or model.
    """
    from edgesync_bench.workloads import WorkloadDataError
    from edgesync_store.semantic.embedders import EmbeddingUnavailableError, get_embedder

    cfg = load_config({"engine": args.engine})
    check_writable(args.json_out)
    if args.workload == "rag":
        return cli_rag.cmd_fidelity_rag(args, cfg)
    try:
        pairs = fidelity.load_pairs(args.pairs)
        app, system_prompt = fidelity.load_system_prompt(args.topic)
        embedder = get_embedder(cfg.embedding_backend)
    except (WorkloadDataError, EmbeddingUnavailableError) as exc:
        raise CommandError(str(exc)) from None
    duplicate = [p.duplicate for p in pairs]
    if all(duplicate) or not any(duplicate):
        raise CommandError(f"{args.pairs or fidelity.PAIRS_FILE}: needs both duplicate and non-duplicate pairs")
    cache_dir = None if args.no_vector_cache else fidelity_vectors.default_vector_cache_dir()
    shares, samples, records, model, timings = _measure(args, cfg, pairs, duplicate, embedder, system_prompt,
                                                        cache_dir)
    doc = report_dict(
        shares, samples, records,
        pairs_file=str(Path(args.pairs) if args.pairs else workloads.data_file(fidelity.PAIRS_FILE)),
        n_pairs=len(pairs), n_dup=sum(duplicate), n_nondup=len(pairs) - sum(duplicate),
        embedding=embedder.backend_id, vector_cache=None if cache_dir is None else str(cache_dir),
        sample_settings={"n": args.sample, "seed": args.seed, "max_tokens": args.max_tokens, "topic": args.topic,
                         "app": app, "model": model, "donor": "question a, alone in a fresh store",
                         "request": "question b", "reference": "question b uncached"},
        timings_s={k: round(v, 2) for k, v in timings.items()},
    )
    text = json.dumps(doc, indent=2)
    write_json_out(args.json_out, text)
    if args.json:
        print(text, flush=True)
    else:
        from edgesync_store.commands.inventory import wide_console

        wide_console().print(render_table(doc))
    return 0


def _measure(args, cfg, pairs, duplicate, embedder, system_prompt, cache_dir):
    """Embed the pairs and count the shares per threshold, then (``--sample N`` > 0) run the
    model on N served pairs per threshold; progress bars on stderr. Returns ``(shares, samples,
    records, model file name or None, {"embed": s, "sample": s})``."""
    from edgesync_store.semantic.embedders import EmbeddingModelError

    timings = {"embed": 0.0, "sample": 0.0}
    model = None
    with progress_bar() as progress:
        tasks: dict[str, Any] = {}
        labels = {"embed": "embedding questions", "sample": "model sample (pairs)"}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(labels.get(stage, stage), total=total)
            progress.update(tasks[stage], completed=done, total=total)

        t0 = time.perf_counter()
        try:
            sims = fidelity.pair_similarities(pairs, embedder, cache_dir, report)
        except EmbeddingModelError as exc:
            raise CommandError(str(exc)) from None
        shares = fidelity.threshold_shares(sims, duplicate, args.thresholds)
        timings["embed"] = time.perf_counter() - t0
        samples, records = [], []
        if args.sample:
            t0 = time.perf_counter()
            with open_edgesync(cfg, store=False) as es:
                model = es.adapter.model_path.name
                try:
                    samples, records = fidelity.sample_fidelity(
                        pairs, sims, args.thresholds, args.sample, system_prompt, seed=args.seed,
                        max_tokens=args.max_tokens, model=es.adapter, config=cfg, progress=report)
                except (ValueError, RuntimeError) as exc:
                    raise CommandError(str(exc)) from None
            timings["sample"] = time.perf_counter() - t0
    return shares, samples, records, model, timings
