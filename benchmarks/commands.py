"""The ``edgesync`` subcommands this distribution adds: ``run``, ``bench`` and ``fidelity``.

Each function here is an entry point of the group ``edgesync.commands`` (benchmarks/pyproject.toml):
``edgesync_engines.app.cli`` loads the group and calls each with the subparsers and the parent
parser holding ``--log-level``; the library never imports this package.
"""

from __future__ import annotations

import argparse

from edgesync_engines.app.cli_common import CommandError


def add_run(sub, common: argparse.ArgumentParser) -> None:
    """``edgesync run WORKLOAD`` (:mod:`edgesync_bench.cli_run`)."""
    from edgesync_bench import cli_run

    cli_run.add_parser(sub, common)


def add_fidelity(sub, common: argparse.ArgumentParser) -> None:
    """``edgesync fidelity`` (:mod:`edgesync_bench.cli_fidelity`)."""
    from edgesync_bench import cli_fidelity

    cli_fidelity.add_parser(sub, common)


def add_bench(sub, common: argparse.ArgumentParser) -> None:
    """``edgesync bench`` (:mod:`edgesync_bench.runner`, the same options as ``python -m
    edgesync_bench.runner``)."""
    from edgesync_bench.runner import add_arguments

    bench = sub.add_parser("bench", parents=[common],
                           help="benchmark every system on the seed, doc-QA and chat workloads (make bench)")
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """``edgesync bench``: :func:`edgesync_bench.runner.run_from_args` (report tables on stdout)."""
    from edgesync_bench.runner import WorkerError, run_from_args
    from edgesync_bench.workloads import WorkloadDataError

    try:
        return run_from_args(args)
    except (WorkerError, WorkloadDataError, ValueError) as exc:
        raise CommandError(str(exc)) from None
