"""The parsers and checks of EdgeSync's settings table (``config.SETTINGS``).

A parser turns environment text into a value and raises ValueError when the text does not
parse; a check takes a value and returns None when it is valid, else what is wrong (the
message after ``"field: "``).
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Sequence

from edgesync_store.commands.units import parse_bytes

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
    try:
        return parse_bytes(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None


def parse_size_or_off(text: str) -> int:
    return 0 if text.strip() == "0" else parse_size(text)


# -- checks: value -> None when valid, else what is wrong (the message after "field: ") --------

Check = Callable[[Any], "str | None"]


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
