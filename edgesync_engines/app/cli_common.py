"""What every ``edgesync`` subcommand shares: the one-line error, configuration and engine
loading, small argument parsers. :class:`CommandError` lives here, not in ``cli.py``, which runs
as ``__main__`` under ``python -m`` (a second copy of the class would not be caught)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from edgesync_engines.config import EdgeSyncConfig
from edgesync_store.errors import StoreError, StoreOpenError

EXIT_USAGE = 2
"""Exit status for bad input: a bad option or setting, missing data, model or store."""
STORE_ARG_HELP = "store directory (default: the configured store)"


def progress_bar(description: str = "[progress.description]{task.description}", console=None, **options):
    """A ``rich.progress.Progress`` with description, bar, done/total, elapsed and remaining time,
    drawn on ``console`` (default: a new stderr console); ``options`` go to ``Progress``."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console if console is not None else Console(stderr=True),
                    **options)


class CommandError(Exception):
    """Bad input, reported as one ``error: <message>`` line on stderr and exit status 2."""


def print_error(message: str) -> None:
    """``error: <message>`` on stderr."""
    print(f"error: {message}", file=sys.stderr, flush=True)


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: text -> an int >= ``minimum`` (and <= ``maximum`` when given;
    ArgumentTypeError otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


positive_int = int_at_least(1)
"""argparse type: an int >= 1."""


def load_config(overrides: dict[str, Any]) -> EdgeSyncConfig:
    """:meth:`EdgeSyncConfig.load` with command-line ``overrides``; CommandError for a bad setting."""
    try:
        return EdgeSyncConfig.load(overrides)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def configured_store(store: str | None) -> Path | str:
    """``store`` when given on the command line, else the configured store path."""
    return store if store is not None else load_config({}).store_path


def open_edgesync(cfg: EdgeSyncConfig, store: Any = None):
    """The EdgeSync of ``cfg`` (model loaded, store opened unless ``store`` is False); CommandError
    when the model, its ONNX export or the store cannot be loaded or opened."""
    from edgesync_engines.adapters.model_files import ModelLoadError, ModelNotFoundError
    from edgesync_engines.adapters.onnx_export import ExportError
    from edgesync_engines.request.router import EdgeSync

    try:
        return EdgeSync(config=cfg, store=store)
    except ModelNotFoundError as exc:
        raise CommandError(f"model not found: {exc}") from None
    except ModelLoadError as exc:
        raise CommandError(f"cannot load the model: {exc}") from None
    except StoreOpenError as exc:
        raise CommandError(str(exc)) from None
    except ExportError as exc:
        raise CommandError(f"no usable ONNX export: {exc}") from None
    except (StoreError, PermissionError) as exc:
        raise CommandError(f"cannot open the store at {cfg.store_path}: {exc}") from None


def check_writable(json_out: str | None) -> None:
    """Fail before a long run, not after it, when ``--json-out FILE`` cannot be written."""
    if not json_out:
        return
    try:
        with open(json_out, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise CommandError(f"--json-out {json_out}: cannot write: {exc}") from None


def write_json_out(json_out: str | None, text: str) -> None:
    """Write ``text`` and a newline to ``--json-out FILE`` when given; CommandError when it fails."""
    if not json_out:
        return
    try:
        Path(json_out).write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {json_out}: {exc}") from None
