"""The ``edgesync`` command: ``generate``, ``run``, ``export-onnx`` (:mod:`.cli_model`), ``dump``,
``clear``, ``reindex`` (:mod:`.cli_store`), ``docs add|list|remove`` (:mod:`.cli_docs`), ``compact``
(:mod:`.compact`), ``fidelity`` (:mod:`.cli_fidelity`), ``serve`` (:mod:`.cli_serve`) and ``bench``
(:mod:`benchmarks.runner`).

Settings come from :meth:`EdgeSyncConfig.load` with the command-line options as overrides, so
precedence is defaults < ``EDGESYNC_*`` environment < command line. Results go to stdout;
progress, summaries, logs and ``error: ...`` lines go to stderr. Bad input (a prompt that does
not fit the context, a bad setting, a missing model, workload data or store) exits 2 without a
traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from edgesync_engines.app import cli_docs, cli_fidelity, cli_model, cli_serve, cli_store
from edgesync_engines.app.cli_common import EXIT_USAGE, LOG_LEVELS, CommandError, print_error
from edgesync_engines.app.workloads import WorkloadDataError
from edgesync_store import compact

EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    """The ``edgesync`` parser: every subcommand, each with ``--log-level``; ``args.func`` runs it."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=argparse.SUPPRESS,
                        help="logging level (default WARNING)")
    parser = argparse.ArgumentParser(
        prog="edgesync",
        description="EdgeSync: a persistent KV-cache fragment store that lets llama.cpp skip prefill.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cli_model.add_parsers(sub, common)
    cli_store.add_parsers(sub, common)
    cli_docs.add_parsers(sub, common)
    compact.add_parser(sub, common)
    cli_fidelity.add_parser(sub, common)
    cli_model.add_export_parser(sub, common)
    cli_serve.add_parser(sub, common)
    bench = sub.add_parser("bench", parents=[common],
                           help="benchmark every system on the seed, doc-QA and chat workloads (make bench)")
    from benchmarks.runner import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(args: argparse.Namespace) -> int:
    """``edgesync bench``: :func:`benchmarks.runner.run_from_args` (report tables on stdout)."""
    from benchmarks.runner import WorkerError, run_from_args

    try:
        return run_from_args(args)
    except (WorkerError, WorkloadDataError, ValueError) as exc:
        raise CommandError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``edgesync`` command; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "WARNING")
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except CommandError as exc:
        print_error(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        print_error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 1
    except OSError as exc:  # e.g. a full disk under stdout or --json-out
        print_error(str(exc))
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
