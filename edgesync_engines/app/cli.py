"""The ``edgesync`` command: the subcommands of :mod:`.cli_model`, :mod:`.cli_store`,
:mod:`.cli_docs`, :mod:`.cli_serve` and ``compact``, plus those other distributions add through
the entry-point group :data:`COMMANDS_GROUP` (listed even when not installed). Settings:
defaults < ``EDGESYNC_*`` < command line. Bad input exits 2 with one ``error: ...`` line."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from importlib.metadata import entry_points
from typing import Sequence

from edgesync_engines.app import cli_docs, cli_model, cli_serve, cli_store
from edgesync_engines.app.cli_common import EXIT_USAGE, CommandError, print_error
from edgesync_store import compact
from edgesync_store.errors import MissingExtraError
from edgesync_store.settings import LOG_LEVELS

EXIT_INTERRUPTED = 130
COMMANDS_GROUP = "edgesync.commands"
"""Entry-point group of added commands: functions ``(subparsers, common)`` adding a subparser."""
MEASUREMENT_COMMANDS = {
    "run": "run a workload uncached and through EdgeSync, request by request, and compare",
    "bench": "benchmark every system on the seed, doc-QA and chat workloads (make bench)",
    "fidelity": "measure the approximate mode on labelled question pairs: shares served, answer agreement",
}
"""The commands of ``edgesync-bench``, listed (with their help) even when it is not installed."""
BENCH_INSTALL = "pip install -e ./benchmarks from a checkout of EdgeSync"


def add_command_plugins(sub, common: argparse.ArgumentParser) -> None:
    """Add every command of the ``edgesync.commands`` entry points, then a stand-in for each
    measurement command none of them added (it prints how to install it and exits 2)."""
    added: dict[str, str] = {}
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        if ep.name in added or ep.name in sub.choices:
            continue
        try:
            ep.load()(sub, common)
        except ImportError as exc:  # installed, but a module it needs is not
            added[ep.name] = f"`edgesync {ep.name}` cannot be loaded ({exc})"
            continue
        added[ep.name] = ""
    for name, text in MEASUREMENT_COMMANDS.items():
        reason = added.get(name, f"`edgesync {name}` is a benchmark command of the edgesync-bench "
                                 f"distribution, which is not installed: {BENCH_INSTALL}")
        if name not in sub.choices:
            p = sub.add_parser(name, parents=[common], help=f"{text} (needs edgesync-bench)")
            p.set_defaults(func=functools.partial(missing_command, reason), accepts_any_arguments=True)


def missing_command(reason: str, args: argparse.Namespace) -> int:
    """The stand-in of a command that is not installed: CommandError(``reason``)."""
    raise CommandError(reason)


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
    cli_model.add_export_parser(sub, common)
    cli_serve.add_parser(sub, common)
    add_command_plugins(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``edgesync`` command; return its exit status."""
    try:
        parser = build_parser()  # loads the added commands' modules
        args, unknown = parser.parse_known_args(argv)
        if unknown and not getattr(args, "accepts_any_arguments", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        level = getattr(args, "log_level", "WARNING")
        logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except (CommandError, MissingExtraError) as exc:
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
