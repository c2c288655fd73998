"""Byte sizes for people: parsing ``512M`` / ``1GiB`` / ``500MB`` and printing decimal
(``6.8 MB``) or binary (``1.0 GiB``) units."""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

__all__ = ["LARGEST_SIZE", "format_binary", "format_bytes", "parse_bytes"]

LARGEST_SIZE = 2**63 - 1
"""The largest size in bytes a setting takes: the largest ``off_t`` (signed 64-bit on Linux)."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(ib|b)?|b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"512M"``, ``"1GiB"``, ``"2g"``, ``"1048576"`` -> bytes: ``K``/``M``/``G``/``T`` and
    ``KiB``... are powers of 1024, ``KB``/``MB``/``GB``/``TB`` powers of 1000.

    Raises:
        argparse.ArgumentTypeError: not a size, a fraction of a byte (``1.5``; ``1.5K`` is 1536),
            under 1 byte, or over :data:`LARGEST_SIZE`.
    """
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 1048576, 512M, 1G)")
    value = Fraction(m.group(1))  # exact: a float would round sizes near 2**63
    if not m.group(2) and value.denominator != 1:
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r} (e.g. 1048576, 1.5M)")
    if m.group(2):
        power = "kmgt".index(m.group(2).lower()) + 1
        value *= (1000 if (m.group(3) or "").lower() == "b" else 1024) ** power
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    if value > LARGEST_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most {LARGEST_SIZE} bytes (8 EiB), got {text!r}")
    return int(value)


def format_binary(n: int | float) -> str:
    """``1073741824`` -> ``"1.0 GiB"`` (binary units, like the sizes ``--max-bytes`` takes)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def format_bytes(n: int | float | None) -> str:
    """Human-readable decimal size: ``'6.8 MB'``; ``'-'`` for None."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover
