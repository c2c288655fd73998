"""Checks of a request's arguments (the Python API's; the HTTP server's schema applies the same
rules). Each raises ValueError naming the argument, what it must be and the value given."""

from __future__ import annotations

import math
import numbers
from typing import Mapping

from edgesync_engines.config import MAX_SEED


def shown(value, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters, for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_text(text: str, name: str) -> None:
    """A string UTF-8 can encode (no lone surrogate such as ``"\\ud800"``); else ValueError naming
    ``name`` and where the lone surrogate is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: must be valid Unicode text, got a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None


def check_chat_messages(messages) -> None:
    """A non-empty list (or tuple) of dicts with string ``role`` and ``content`` (valid
    Unicode), not all blank. Any role is accepted (a chat template may know ``tool``). Raises
    ValueError naming what is wrong."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"prompt: chat messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("prompt: no chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"prompt: messages[{i}] must be a dict with string 'role' and 'content'")
        check_text(m["role"], f"prompt: messages[{i}] role")
        check_text(m["content"], f"prompt: messages[{i}] content")
    if all(not m["content"].strip() for m in messages):
        raise ValueError("prompt: every chat message is empty")


def is_int(value) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_sampling(max_tokens, temperature, top_p, seed, stop) -> tuple[int, float, float, int, list[str]]:
    """``generate``'s sampling arguments, checked and returned as plain values (``stop`` as a
    list): ``max_tokens`` an int >= 1, ``temperature`` a finite number >= 0, ``top_p`` in
    (0, 1], ``seed`` an int in 0..``MAX_SEED``, ``stop`` None, a string, or a list or tuple of
    strings (any number; the HTTP server takes at most 4). A bool is neither an int nor a number.

    Raises ValueError naming the argument, what it must be and the value given.
    """
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens: must be an int >= 1, got {shown(max_tokens)}")
    if not is_number(temperature) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature: must be a finite number >= 0, got {shown(temperature)}")
    if not is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be a number in (0, 1], got {shown(top_p)}")
    if not is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed: must be an int in 0..{MAX_SEED}, got {shown(seed)}")
    if stop is None or isinstance(stop, str):
        stops = [] if stop is None else [stop]
        if stop is not None:
            check_text(stop, "stop")
    elif isinstance(stop, (list, tuple)):
        stops = list(stop)
        for i, s in enumerate(stops):
            if not isinstance(s, str):
                raise ValueError(f"stop[{i}]: must be a string, got {shown(s)}")
            check_text(s, f"stop[{i}]")
    else:
        raise ValueError(f"stop: must be a string or a list of strings, got {shown(stop)}")
    return int(max_tokens), float(temperature), float(top_p), int(seed), stops


def check_messages_text(messages) -> None:
    """The string ``role`` and ``content`` of each message (mappings; other items are left to
    the prompt builder) are valid Unicode text; else ValueError naming the message and the lone
    surrogate."""
    for i, m in enumerate(messages if isinstance(messages, (list, tuple)) else ()):
        for key in ("role", "content"):
            if isinstance(m, Mapping) and isinstance(m.get(key), str):
                check_text(m[key], f"prompt: messages[{i}] {key}")
