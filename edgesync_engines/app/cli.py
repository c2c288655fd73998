"""The ``edgesync`` command: ``generate``, ``run``, ``dump``, ``clear``, ``reindex``, ``fidelity``,
``bench`` and ``export-onnx``.

Settings come from :meth:`EdgeSyncConfig.load` with the command-line options as overrides, so
precedence is defaults < ``EDGESYNC_*`` environment < command line. Results go to stdout;
progress, summaries, logs and ``error: ...`` lines go to stderr. Bad input (a prompt that does
not fit the context, a bad setting, a missing model, workload data or store) exits 2 without a
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

import lmdb

from edgesync_store.commands.dump import print_dump
from edgesync_store.commands.inventory import wide_console
from edgesync_store.commands.units import format_bytes
from edgesync_store.core.store import StoreFormatError, StoreOpenError

from edgesync_engines.app import run_report as runreport
from edgesync_engines.app import cli_fidelity
from edgesync_engines.config import EMBEDDING_BACKENDS, ENGINES, REUSE_MODES, EdgeSyncConfig
from edgesync_engines.adapters.model_files import ModelLoadError, ModelNotFoundError
from edgesync_engines.adapters.onnx_export import ExportError
from edgesync_engines.app.workloads import WORKLOAD_NAMES, WorkloadDataError, load_workload

log = logging.getLogger("edgesync.cli")

EXIT_USAGE = 2
RUN_MAX_TOKENS = 16
"""``edgesync run``'s generation length when neither --max-tokens nor EDGESYNC_MAX_TOKENS is set."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ENGINE_HELP = "llamacpp (default) or onnx (ONNX Runtime on `edgesync export-onnx`'s export of the same GGUF)"
CONVERTIBLE_HELP = ("also inject KV another engine wrote for the same model, converted: close to, not always "
                    "equal to, this engine's own output")
REUSE_HELP = ("exact (default): inject only token-identical KV, answers equal uncached runs; "
              "semantic: also serve a donor prompt at similarity >= 0.92 whole (approximate answers)")


class _Fail(Exception):
    """An error reported as one ``error: ...`` line and exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _workload_name(text: str) -> str:
    return text.strip().lower().replace("_", "-")


def _err(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=argparse.SUPPRESS,
                        help="logging level (default WARNING)")

    parser = argparse.ArgumentParser(
        prog="edgesync",
        description="EdgeSync: a persistent KV-cache fragment store that lets llama.cpp skip prefill.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", parents=[common], help="answer one prompt, reusing stored KV")
    gen.add_argument("prompt", help="the user message (or, with --raw, the whole prompt text)")
    gen.add_argument("--store", help="store directory (default: EDGESYNC_STORE or the per-user cache dir)")
    gen.add_argument("--max-tokens", type=int, help="tokens to generate at most")
    gen.add_argument("--json", action="store_true", help="print one JSON object (the result) instead of streaming")
    gen.add_argument("--system", help="system message sent before the prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt string as is (no chat template)")
    gen.add_argument("--no-cache", action="store_true", help="do not use the fragment store")
    gen.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling mass when temperature > 0")
    gen.add_argument("--seed", type=int, help="sampling seed")
    gen.add_argument("--reuse", choices=REUSE_MODES, help=REUSE_HELP)
    gen.add_argument("--engine", type=str.lower, choices=ENGINES, help=ENGINE_HELP)
    gen.add_argument("--allow-convertible", action="store_true", default=None, help=CONVERTIBLE_HELP)
    gen.set_defaults(func=cmd_generate)

    run = sub.add_parser("run", parents=[common],
                         help="run a workload uncached and through EdgeSync, request by request, and compare")
    run.add_argument("workload", type=_workload_name, choices=WORKLOAD_NAMES, metavar="WORKLOAD",
                     help=f"one of: {', '.join(WORKLOAD_NAMES)}")
    run.add_argument("--limit", type=_positive_int, help="run only the first N requests")
    run.add_argument("--store", help="store directory (default: EDGESYNC_STORE or the per-user cache dir)")
    run.add_argument("--max-tokens", type=int, help="tokens to generate per request (default 16, or EDGESYNC_MAX_TOKENS)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    run.add_argument("--json-out", metavar="FILE", help="also write the JSON object to FILE")
    run.add_argument("--reuse", choices=REUSE_MODES, help=REUSE_HELP)
    run.add_argument("--engine", type=str.lower, choices=ENGINES, help=ENGINE_HELP)
    run.add_argument("--allow-convertible", action="store_true", default=None, help=CONVERTIBLE_HELP)
    run.set_defaults(func=cmd_run)

    dump = sub.add_parser("dump", parents=[common], help="list the fragments of a store (read-only)")
    dump.add_argument("store", nargs="?", help="store directory (default: the configured store)")
    dump.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    dump.add_argument("--limit", type=_positive_int, help="show at most N fragments")
    dump.add_argument("--summary", action="store_true",
                      help="counts and bytes by tier (short, long, expired, total) and the budget use, "
                           "instead of one line per fragment")
    dump.set_defaults(func=cmd_dump)

    clear = sub.add_parser("clear", parents=[common],
                           help="erase everything a store holds (fragments, index, donors, vectors, sidecar)")
    clear.add_argument("store", nargs="?", help="store directory (default: the configured store)")
    clear.add_argument("--yes", "-y", action="store_true",
                       help="do not ask for confirmation (required when stdin is not a terminal)")
    clear.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    clear.set_defaults(func=cmd_clear)

    reindex = sub.add_parser("reindex", parents=[common],
                             help="rebuild a store's semantic index (HNSW sidecar) from LMDB")
    reindex.add_argument("store", nargs="?", help="store directory (default: the configured store)")
    reindex.add_argument("--backend", choices=EMBEDDING_BACKENDS,
                         help="embedding backend; another than the store's re-embeds every stored prompt")
    reindex.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    reindex.set_defaults(func=cmd_reindex)

    cli_fidelity.add_parser(sub, common)

    export = sub.add_parser("export-onnx", parents=[common],
                            help="build the ONNX Runtime decoder of the GGUF (once; needs the `onnx` extra)")
    export.add_argument("--model", help="GGUF file (default: EDGESYNC_MODEL or SmolLM2-135M-Instruct)")
    export.add_argument("--out", help="export root (default: EDGESYNC_ONNX_DIR or the per-user cache dir)")
    export.add_argument("--force", action="store_true", help="export again even if a complete export is there")
    export.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    export.set_defaults(func=cmd_export_onnx)

    bench = sub.add_parser("bench", parents=[common],
                           help="benchmark every system on the seed, doc-QA and chat workloads (make bench)")
    from benchmarks.runner import add_arguments as _bench_arguments

    _bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(args) -> int:
    """``edgesync bench``: :func:`benchmarks.runner.run_from_args` (report tables on stdout)."""
    from benchmarks.runner import WorkerError, run_from_args

    try:
        return run_from_args(args)
    except (WorkerError, WorkloadDataError, ValueError) as exc:
        raise _Fail(str(exc)) from None


def _load_config(overrides: dict[str, Any]) -> EdgeSyncConfig:
    try:
        return EdgeSyncConfig.load(overrides)
    except ValueError as exc:
        raise _Fail(str(exc)) from None


def _open(cfg: EdgeSyncConfig, store=None):
    """The EdgeSync of ``cfg`` (model loaded, store opened unless disabled)."""
    from edgesync_engines.request.router import EdgeSync

    try:
        return EdgeSync(config=cfg, store=store)
    except ModelNotFoundError as exc:
        raise _Fail(f"model not found: {exc}") from None
    except ModelLoadError as exc:
        raise _Fail(f"cannot load the model: {exc}") from None
    except StoreOpenError as exc:
        raise _Fail(str(exc)) from None
    except ExportError as exc:
        raise _Fail(f"no usable ONNX export: {exc}") from None
    except (lmdb.Error, StoreFormatError, PermissionError) as exc:
        raise _Fail(f"cannot open the store at {cfg.store_path}: {exc}") from None


# -- generate ---------------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    cfg = _load_config({
        "store_path": args.store,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "cache_enabled": False if args.no_cache else None,
        "reuse": args.reuse,
        "engine": args.engine,
        "allow_convertible": args.allow_convertible,
    })
    if args.raw:
        if args.system is not None:
            raise _Fail("--system cannot be combined with --raw (the raw prompt is sent as is)")
        prompt: Any = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        prompt.append({"role": "user", "content": args.prompt})

    with _open(cfg, store=False if args.no_cache else None) as es:
        try:
            if args.json:
                result = es.generate(prompt)
            else:
                stream = es.generate(prompt, stream=True)
        except ValueError as exc:  # ContextOverflowError is a ValueError
            raise _Fail(str(exc)) from None
        if args.json:
            print(json.dumps(result.to_dict()), flush=True)
            return 0
        last = ""
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
            last = piece or last
        if not last.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        r = stream.result
        print(
            f"[{r.tier}] prompt {r.prompt_tokens} tokens, reused {r.tokens_reused}, "
            f"prefilled {r.tokens_prefilled}, generated {len(r.tokens)}; "
            f"TTFT {r.ttft_ms:.1f} ms, total {r.total_ms:.1f} ms; read {format_bytes(r.bytes_read)}"
            + (f", wrote {r.fragments_written} fragments" if r.fragments_written else "")
            + (f"; similarity {r.similarity:.3f}" if r.similarity is not None else "")
            + ("; APPROXIMATE: answered from another prompt's KV" if r.approximate else "")
            + (f"; CONVERTED: {r.source_engine} KV injected" if r.convertible else ""),
            file=sys.stderr,
            flush=True,
        )
    return 0


# -- run ----------------------------------------------------------------------------------------

def run_workload(es, requests, max_tokens: int, progress=None, task=None) -> list[dict]:
    """Each request once uncached (same adapter, no store: a cleared KV cache every time) and
    then once through ``es``, interleaved request by request; returns the per-request records."""
    from edgesync_engines.request.router import EdgeSync

    baseline = EdgeSync(es.adapter, store=False, config=es.config)
    records = []
    for req in requests:
        messages = req.as_messages()
        uncached = baseline.generate(messages, max_tokens=max_tokens)
        cached = es.generate(messages, max_tokens=max_tokens)
        records.append(runreport.request_record(req, uncached, cached))
        if progress is not None:
            progress.update(task, advance=1, description=f"{req.request_id} {cached.tier:>7}")
    return records


def cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    import os

    if args.max_tokens is None and not os.environ.get("EDGESYNC_MAX_TOKENS", "").strip():
        args.max_tokens = RUN_MAX_TOKENS
    cfg = _load_config({"store_path": args.store, "max_tokens": args.max_tokens, "reuse": args.reuse,
                        "engine": args.engine, "allow_convertible": args.allow_convertible})
    args.max_tokens = cfg.max_tokens
    if args.json_out:  # fail before the run, not after it
        try:
            with open(args.json_out, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise _Fail(f"--json-out {args.json_out}: cannot write: {exc}") from None
    try:
        requests = load_workload(args.workload, limit=args.limit)
    except (WorkloadDataError, ValueError) as exc:
        raise _Fail(str(exc)) from None
    err = Console(stderr=True)
    with _open(cfg) as es:
        with Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err,
            transient=False,
        ) as progress:
            task = progress.add_task(f"{args.workload}", total=len(requests))
            try:
                records = run_workload(es, requests, args.max_tokens, progress, task)
            except ValueError as exc:  # a request that does not fit the context
                raise _Fail(str(exc)) from None
        stats = es.store.stats().to_dict() if es.store is not None else None
        model = es.adapter.model_path.name
    summary = runreport.summarize(records)
    doc = {
        "workload": args.workload,
        "n_requests": len(records),
        "max_tokens": args.max_tokens,
        "model": model,
        "engine": cfg.engine,
        "allow_convertible": cfg.allow_convertible,
        "store_path": str(cfg.store_path) if stats is not None else None,
        "summary": summary,
        "store": stats,
        "requests": runreport.request_rows(records),
    }
    text = json.dumps(doc, indent=2)
    if args.json_out:
        try:
            Path(args.json_out).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            raise _Fail(f"cannot write {args.json_out}: {exc}") from None
    if args.json:
        print(text, flush=True)
    else:
        title = (f"workload {args.workload}: {len(records)} requests, "
                 f"store {doc['store_path'] or 'disabled'}, model {model}, engine {cfg.engine}"
                 + (" (convertible KV allowed)" if cfg.allow_convertible else ""))
        wide_console().print(runreport.render_table(summary, stats, title))
    return 0


# -- export-onnx --------------------------------------------------------------------------------

def cmd_export_onnx(args: argparse.Namespace) -> int:
    """``edgesync export-onnx``: :func:`onnx_export.export_gguf`; prints the directory."""
    import time

    from edgesync_engines.adapters.onnx_export import export_gguf, read_meta

    cfg = _load_config({"model_path": args.model})
    try:
        from edgesync_engines.adapters.model_files import default_model_path

        from rich.console import Console

        gguf = cfg.model_path or default_model_path()
        t0 = time.perf_counter()
        with Console(stderr=True).status(f"exporting {Path(gguf).name} to ONNX (a few minutes the first time)"):
            out = export_gguf(gguf, root=args.out, force=args.force)
        meta = read_meta(out)
    except (OSError, ExportError) as exc:
        raise _Fail(str(exc)) from None
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    doc = {"export_dir": str(out.resolve()), "source": str(gguf), "source_fingerprint": meta["source_fingerprint"],
           "bytes": size, "seconds": round(time.perf_counter() - t0, 1), "n_layer": meta["n_layer"],
           "n_head_kv": meta["n_head_kv"], "head_dim": meta["head_dim"]}
    if args.json:
        print(json.dumps(doc), flush=True)
    else:
        print(f"{doc['export_dir']}: ONNX decoder of {Path(gguf).name} ({format_bytes(size)}, "
              f"{meta['n_layer']} layers x {meta['n_head_kv']} KV heads x {meta['head_dim']}) "
              f"in {doc['seconds']} s", flush=True)
    return 0


# -- dump ---------------------------------------------------------------------------------------

def cmd_dump(args: argparse.Namespace) -> int:
    store = args.store if args.store is not None else _load_config({}).store_path
    return print_dump(store, as_json=args.json, limit=args.limit, summary_only=args.summary)


# -- clear --------------------------------------------------------------------------------------

EXIT_DECLINED = 1
"""``edgesync clear``'s exit status when the user answers no at the confirmation prompt."""


def _confirm(question: str) -> bool:
    """Ask ``question`` on the terminal (stderr); True only for an explicit yes."""
    from rich.console import Console
    from rich.prompt import Confirm

    try:
        return Confirm.ask(question, console=Console(stderr=True), default=False)
    except EOFError:
        return False


def cmd_clear(args: argparse.Namespace) -> int:
    """``edgesync clear``: :func:`edgesync_store.commands.clear.clear_store` after a confirmation (or
    ``--yes``); what was removed goes to stdout. Exit 0, 1 when the user declines, 2 for bad
    input or a refusal to clear without ``--yes`` when stdin is not a terminal."""
    from edgesync_store.commands.clear import check_store_path, clear_store
    from edgesync_store.commands.inventory import StoreNotFoundError
    from edgesync_store.core.store import StoreBusyError

    store = args.store if args.store is not None else _load_config({}).store_path
    try:
        path = check_store_path(store)
    except (StoreNotFoundError, StoreOpenError) as exc:
        raise _Fail(str(exc)) from None
    if not args.yes:
        if not sys.stdin.isatty():
            raise _Fail(f"refusing to clear {path} without --yes (stdin is not a terminal to confirm on)")
        if not _confirm(f"Erase every fragment, donor and vector of the store at {path}?"):
            print(f"not cleared: {path} left as it was", file=sys.stderr, flush=True)
            return EXIT_DECLINED
    try:
        result = clear_store(path)
    except (StoreNotFoundError, StoreOpenError, StoreFormatError, StoreBusyError) as exc:
        raise _Fail(str(exc)) from None
    except (lmdb.Error, OSError) as exc:
        raise _Fail(f"cannot clear the store at {path}: {exc}") from None
    if args.json:
        print(json.dumps(result.to_dict()), flush=True)
    else:
        how = ("files erased (" + ", ".join(result.files_removed) + ") and an empty store created"
               if result.erased_files else f"files not erased: {result.reason}")
        print(f"cleared {result.path}: {result.fragments_removed} fragments removed; data.mdb "
              f"{format_bytes(result.bytes_before)} -> {format_bytes(result.bytes_after)}; {how}", flush=True)
    return 0


# -- reindex ------------------------------------------------------------------------------------

def cmd_reindex(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from edgesync_store.semantic.embedders import EmbeddingUnavailableError
    from edgesync_store.semantic.index import BackendMismatchError, IndexUnavailableError
    from edgesync_store.semantic.reindex import reindex

    store = args.store if args.store is not None else _load_config({}).store_path
    if not str(store).strip():
        raise _Fail("store path: is empty")
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = None

        def progress(stage: str, done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task(stage, total=total)
            bar.update(task, completed=done, description=stage)

        try:
            report = reindex(store, backend=args.backend, progress=progress)
        except (StoreOpenError, StoreFormatError, ValueError, EmbeddingUnavailableError, IndexUnavailableError,
                BackendMismatchError) as exc:
            raise _Fail(str(exc)) from None
        except (lmdb.Error, OSError) as exc:
            raise _Fail(f"store {store}: {exc}") from None
    if args.json:
        print(json.dumps(report.to_dict()), flush=True)
    else:
        dropped = (f", {report.vectors_dropped} vectors of {report.previous_backend_id} dropped"
                   if report.vectors_dropped else "")
        print(f"{report.store}: {report.vectors_indexed} vectors indexed with {report.backend_id} "
              f"({report.donors_embedded} prompts embedded{dropped}, {report.donors_removed} stale prompt "
              f"records removed) in {report.seconds:.1f} s", flush=True)
    return 0


# -- entry point --------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``edgesync`` command; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "WARNING")
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except _Fail as exc:
        _err(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:
        return 1
    except OSError as exc:  # e.g. a full disk under stdout or --json-out
        _err(str(exc))
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
