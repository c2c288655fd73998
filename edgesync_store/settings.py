"""Settings declared as dataclass fields, and the store's own settings (:class:`StoreSettings`).

A setting is a frozen dataclass field made by :func:`setting` (or :func:`flag`); its metadata
holds the environment variable, the text parser (raises ValueError), the check (returns None or
what is wrong) and the help line; :func:`table` reads them back. :func:`load` layers defaults <
``EDGESYNC_*`` < overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import platformdirs

from edgesync_store.commands.units import LARGEST_SIZE, format_binary, parse_bytes
from edgesync_store.core.codec import COMPRESSIONS, DEFAULT_COMPRESSION
from edgesync_store.core.store import DEFAULT_FREE_SHARE, DEFAULT_MAX_BYTES
from edgesync_store.ttl import DEFAULT_TTL_SECONDS

__all__ = ["Check", "Setting", "StoreSettings", "as_dict", "check_fields", "default_store_path", "flag", "load",
           "markdown_rows", "setting", "setting_of", "table"]

T = TypeVar("T")

Check = Callable[[Any], "str | None"]
"""value -> None when valid, else what is wrong (raised as ``"field: <what>"``)."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The ``--log-level`` choices of the commands (the ``logging`` module's level names)."""

DEFAULT_SWEEP_INTERVAL_S = 60.0
DEFAULT_COMPACT_INTERVAL_S = 900.0
"""Default seconds between the scheduled expiry sweeps and between compactions (``lifecycle.jobs``)."""


# -- environment parsers: text -> value, ValueError when the text does not parse ---------------


def parse_flag(text: str) -> bool:
    """``1 true yes on`` / ``0 false no off`` and empty, any case."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_size(text: str) -> int:
    """A size in bytes as ``units.parse_bytes`` reads it (``512M``, ``1GiB``, ``500MB``)."""
    try:
        return parse_bytes(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None


def parse_size_or_off(text: str) -> int:
    """:func:`parse_size`, or 0 for ``"0"`` (off)."""
    return 0 if text.strip() == "0" else parse_size(text)


def lower(value: Any) -> Any:
    """A coercion: text stripped and lower-cased; other values unchanged."""
    return value.strip().lower() if isinstance(value, str) else value


def as_path(value: Any) -> Any:
    """A coercion: text -> ``Path``; other values unchanged."""
    return Path(value) if isinstance(value, str) else value


# -- checks: value -> None when valid, else what is wrong ---------------------------------------


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be True or False, got {value!r}"


def one_of(choices: Sequence[str]) -> Check:
    return lambda v: None if v in choices else f"{v!r} is not one of {', '.join(choices)}"


def at_least_one(v: Any) -> str | None:
    return f"must be >= 1, got {v}" if v < 1 else None


def unit_interval(v: Any) -> str | None:
    return None if isinstance(v, (int, float)) and 0 < v <= 1 else f"must be in (0, 1], got {v}"


def finite_positive(v: Any) -> str | None:
    return None if math.isfinite(v) and v > 0 else f"must be a finite number > 0, got {v}"


def seconds(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
    return None if ok else f"must be a positive number of seconds, got {v!r}"


def optional_count(v: Any) -> str | None:
    return None if v is None or (is_int(v) and v >= 1) else f"must be None or an int >= 1, got {v!r}"


def optional_size(v: Any) -> str | None:
    """None or a size from 1 byte to ``units.LARGEST_SIZE``."""
    return None if v is None or (is_int(v) and 1 <= v <= LARGEST_SIZE) \
        else f"must be None or bytes from 1 to {LARGEST_SIZE}, got {v!r}"


def binary(n: int) -> str:
    """A size for the README's default column: ``1 GiB`` (``units.format_binary`` without ``.0``)."""
    return format_binary(n).replace(".0 ", " ")


# -- the declaration and the table -------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One row of a settings table: a field of a settings dataclass and its metadata.

    Attributes:
        name: the field, and the key of :func:`load`'s overrides.
        type: the field's annotation, as written (``"int"``, ``"float | None"``, ...).
        default: the default value, or (``factory=True``) a function returning it.
        env: the environment variable (its text goes through ``parse``).
        parse: environment text -> value; raises ValueError when the text does not parse.
        help: one line: what the setting does, with its unit.
        check: value -> None, or the reason it is invalid (raised as ``"name: reason"``).
        coerce: applied to every given value before ``check`` (``str`` -> ``Path``, case).
        shown: the README's default column when the default's own text does not say it.
        factory: ``default`` is a zero-argument function.
        secret: the environment text may hold a password: error messages never quote it.
    """

    name: str
    type: Any
    default: Any
    env: str
    parse: Callable[[str], Any]
    help: str
    check: Check | None = None
    coerce: Callable[[Any], Any] | None = None
    shown: str | None = None
    factory: bool = False
    secret: bool = False

    def shown_default(self) -> str:
        """The default as the README's table shows it."""
        if self.shown is not None:
            return self.shown
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, str):
            return f"`{self.default}`"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)


def setting(default: Any = dataclasses.MISSING, *, env: str, parse: Callable[[str], Any], help: str,
            factory: Callable[[], Any] | None = None, check: Check | None = None,
            coerce: Callable[[Any], Any] | None = None, shown: str | None = None, secret: bool = False) -> Any:
    """A settings dataclass field: ``default`` (or ``factory()``), with the rest of its
    :class:`Setting` row in the field's metadata."""
    meta = {"env": env, "parse": parse, "help": help, "check": check, "coerce": coerce, "shown": shown,
            "secret": secret}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag(default: bool, env: str, help: str) -> Any:
    """An on/off :func:`setting` (``1 true yes on`` / ``0 false no off``)."""
    return setting(default, env=env, parse=parse_flag, help=help, check=check_flag)


def setting_of(cls: type, name: str) -> Any:
    """A new declaration of ``cls``'s setting ``name`` with its default and metadata (the annotation
    is written again; ``tests/test_config.py`` checks that they agree)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


@functools.cache
def table(cls: type) -> tuple[Setting, ...]:
    """The :class:`Setting` rows of a settings dataclass, in field order."""
    rows = []
    for f in dataclasses.fields(cls):
        factory = f.default_factory is not dataclasses.MISSING
        rows.append(Setting(name=f.name, type=f.type, default=f.default_factory if factory else f.default,
                            factory=factory, **f.metadata))
    return tuple(rows)


def check_fields(obj: Any) -> None:
    """Coerce and check every setting of ``obj``; ValueError ``"name: reason"`` for the first bad one."""
    for s in table(type(obj)):
        value = getattr(obj, s.name)
        if s.coerce is not None:
            try:
                value = s.coerce(value)
            except ValueError as exc:  # the coercion's message says what (a URL's is redacted)
                raise ValueError(f"{s.name}: {exc}") from None
            object.__setattr__(obj, s.name, value)
        problem = s.check(value) if s.check is not None else None
        if problem:
            raise ValueError(f"{s.name}: {problem}")


def load(cls: Callable[..., T], overrides: Mapping[str, Any] | None = None,
         environ: Mapping[str, str] | None = None) -> T:
    """An instance of ``cls``: defaults, then its variables in ``environ`` (default ``os.environ``),
    then ``overrides`` by field name (None and blank strings are "not given"). Raises ValueError
    naming a value that does not parse or is out of range (and its variable), or an unknown override.
    """
    rows = table(cls)  # type: ignore[arg-type]
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for s in rows:
        raw = environ.get(s.env)
        if raw is None or raw.strip() == "":
            continue
        given = s.env if s.secret else f"{s.env}={raw!r}"  # a secret's parse error redacts it itself
        try:
            values[s.name] = s.parse(raw)
        except ValueError as exc:
            # int() and float() word their errors for programmers ("invalid literal for int()")
            reason = {int: "not a whole number", float: "not a number"}.get(s.parse, str(exc))
            raise ValueError(f"{given}: {reason}") from None
        source[s.name] = given
    names = {s.name for s in rows}
    for name, value in (overrides or {}).items():
        if name not in names:
            raise ValueError(f"unknown setting {name!r}")
        if value is None or (isinstance(value, str) and not value.strip()):
            continue  # not given
        values[name] = value
        source.pop(name, None)
    try:
        return cls(**values)
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        if field in source:
            raise ValueError(f"{exc} (from {source[field]})") from None
        raise


def as_dict(obj: Any) -> dict[str, Any]:
    """JSON-able view of a settings dataclass: every setting by field name; values other than
    None, bool, int, float and str as their ``str`` (paths; a remote URL prints redacted)."""
    out = {}
    for s in table(type(obj)):
        value = getattr(obj, s.name)
        out[s.name] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
    return out


def markdown_rows(cls: type) -> list[str]:
    """One GitHub Markdown table row per setting of ``cls``: setting, variable, default, help."""
    return [f"| `{s.name}` | `{s.env}` | {s.shown_default()} | {s.help} |" for s in table(cls)]


# -- the store's settings ----------------------------------------------------------------------


def default_store_path() -> Path:
    """The per-user cache directory's ``store`` folder (e.g. ``~/.cache/edgesync/store``)."""
    return Path(platformdirs.user_cache_dir("edgesync")) / "store"


@dataclass(frozen=True)
class StoreSettings:
    """The settings the store and its maintenance read: directory, new fragments' lifetime, size
    budget (None: the one recorded in the store, else ``core.store.default_max_bytes``), K/V
    encoding, the sweep and compaction schedule.
    ``EdgeSyncConfig`` redeclares them with :func:`setting_of`. Construct with :meth:`load` or
    keywords (ValueError ``"field: reason"``)."""

    store_path: Path = setting(
        factory=default_store_path, env="EDGESYNC_STORE", parse=Path, help="fragment store directory",
        coerce=as_path, shown="per-user cache dir (`~/.cache/edgesync/store`)")
    ttl_seconds: float = setting(
        float(DEFAULT_TTL_SECONDS), env="EDGESYNC_TTL_SECONDS", parse=float,
        help="fragment lifetime from creation, seconds", check=finite_positive)
    max_bytes: int | None = setting(
        None, env="EDGESYNC_MAX_BYTES", parse=parse_size,
        help="size budget of the store, bytes of stored fragments (`512M`, `1G`: powers of 1024; `500MB`: of 1000)",
        check=optional_size,
        shown=f"the budget recorded in the store, else the smaller of {binary(DEFAULT_MAX_BYTES)} and "
              f"{DEFAULT_FREE_SHARE:.0%} of the disk space free when it is created (recorded)")
    compression: str = setting(
        DEFAULT_COMPRESSION, env="EDGESYNC_COMPRESSION", parse=lower,
        help="how new fragments hold K and V: `none` (a hit reads them in place, no decompression) or `zstd` "
             "(about 0.86x the bytes of f16 KV, decompressed on every read)",
        check=one_of(COMPRESSIONS), coerce=lower)
    jobs: bool = flag(True, "EDGESYNC_JOBS", "run the expiry sweep and compaction on a schedule in the app process")
    sweep_interval_s: float = setting(
        DEFAULT_SWEEP_INTERVAL_S, env="EDGESYNC_SWEEP_INTERVAL_S", parse=float,
        help="seconds between expiry sweeps", check=seconds)
    compact_interval_s: float = setting(
        DEFAULT_COMPACT_INTERVAL_S, env="EDGESYNC_COMPACT_INTERVAL_S", parse=float,
        help="seconds between compactions", check=seconds)

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> StoreSettings:
        """:func:`load`: defaults < ``EDGESYNC_*`` < ``overrides``; ValueError names a bad setting."""
        return load(cls, overrides, environ)

    def to_dict(self) -> dict[str, Any]:
        """:func:`as_dict`: every setting by field name, the path as a string."""
        return as_dict(self)
