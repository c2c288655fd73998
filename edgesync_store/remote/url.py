"""The remote tier's address: a ``redis://`` or ``rediss://`` URL whose secret never shows.

:class:`RemoteURL` is read by redis-py's own URL parser (``redis.connection.parse_url``, the one
its clients connect with); its ``str()`` and ``repr()`` show the password as ``***``
(:func:`redact`, textual, so a URL no parser reads as meant is hidden too). Only
:attr:`RemoteURL.secret` gives the URL as typed. User and password may also come from
``EDGESYNC_REMOTE_USERNAME`` / ``EDGESYNC_REMOTE_PASSWORD`` (:func:`credentials`).
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from edgesync_store.errors import require_extra

SCHEMES = ("redis", "rediss")
"""``redis``: plain TCP; ``rediss``: TLS (redis-py's schemes; its ``unix://`` is not taken)."""
USERNAME_ENV = "EDGESYNC_REMOTE_USERNAME"
PASSWORD_ENV = "EDGESYNC_REMOTE_PASSWORD"
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A key prefix: 1 to 64 letters, digits, ``_ . -``. No ``:`` (it ends the prefix in every key, so
``shop`` never owns ``shop:17``'s keys), no braces (a Cluster hash tag), no glob characters
(``clear`` scans ``PREFIX:*``)."""

__all__ = ["MAX_DB", "PASSWORD_ENV", "PREFIX_PATTERN", "RemoteURL", "SCHEMES", "UNSAFE_IN_USERINFO", "USERNAME_ENV",
           "check_prefix", "credentials", "redact"]


MAX_DB = 2**31 - 1
"""The largest database number Redis's ``SELECT`` takes (a C ``int``)."""
UNSAFE_IN_USERINFO = "/?#"
"""Characters that end a URL's user and password part (RFC 3986); percent-encoded they are fine."""
_SHOWN_USER = re.compile(r"^[A-Za-z0-9._~%!$&'()*+,;=-]*$")
"""A user name shown in a redacted URL: RFC 3986's user characters only."""


def redact(text: str) -> str:
    """``text`` with everything between ``://`` and the last ``@`` (all before the last ``@``
    without ``://``) replaced by ``user:***`` (or ``***`` when the user is not plainly one), and
    everything after a ``password=`` query argument's ``=`` by ``***``."""
    scheme_end = text.find("://")
    start = 0 if scheme_end < 0 else scheme_end + 3
    at = text.rfind("@")
    if at >= start:
        userinfo = text[start:at]
        user, colon, _password = userinfo.partition(":")
        shown = f"{user}:***" if colon and scheme_end >= 0 and _SHOWN_USER.match(user) else "***"
        text = text[:start] + shown + text[at:]
    # to the end, not to the next '&': a password typed with an '&' would show its tail otherwise
    return re.sub(r"(password=).*", r"\1***", text, flags=re.DOTALL)


class RemoteURL:
    """A validated remote-tier URL, ``redis[s]://[user[:password]@]host[:port][/db][?query]``.

    Raises:
        ValueError: not a string, another scheme, no host, a bad port, a path that is not a
            database number, a database outside 0..:data:`MAX_DB`, a query value redis-py
            refuses, a user or password holding an unencoded ``/``, ``?`` or ``#``; the message
            shows the URL through :func:`redact` only.
        MissingExtraError: redis-py (the ``remote`` extra) is not installed.
    """

    __slots__ = ("_text", "_options")

    def __init__(self, text: str) -> None:
        if isinstance(text, RemoteURL):
            text = text.secret
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"must be a redis:// or rediss:// URL, got {type(text).__name__}")
        self._text = text.strip()
        shown = self.redacted
        scheme, sep, rest = self._text.partition("://")
        if scheme not in SCHEMES or not sep:
            raise ValueError(f"{shown}: the scheme must be redis:// or rediss:// (TLS)")
        at = rest.rfind("@")
        if at >= 0 and any(c in rest[:at] for c in UNSAFE_IN_USERINFO):
            raise ValueError(f"{shown}: the user name or password holds '/', '?' or '#' as typed: percent-encode "
                             "them (%2F, %3F, %23; '@' as %40, '%' as %25; an '@' in the path or query as %40)")
        parse_url = require_extra("redis.connection", "remote", "the remote tier").parse_url
        try:
            self._options = parse_url(self._text)
        except ValueError as exc:  # redis-py's own messages name an argument; urllib's quote the port
            reason = exc if str(exc).startswith("Invalid value") else "bad host or port"
            raise ValueError(f"{shown}: {reason}") from None
        if not self._options.get("host"):
            raise ValueError(f"{shown}: no host")
        if "db" not in self._options and urlsplit(self._text).path.strip("/"):  # redis-py would ignore it
            raise ValueError(f"{shown}: the path must be a database number (/0, /1, ...)")
        if not 0 <= self.db <= MAX_DB:
            raise ValueError(f"{shown}: the database number {self.db} is out of range (0 to {MAX_DB})")

    scheme = property(lambda self: self._text.partition("://")[0], doc="``redis`` or ``rediss``.")
    host = property(lambda self: self._options["host"], doc="The host name or address.")
    port = property(lambda self: self._options.get("port", 6379), doc="The TCP port (default 6379).")
    db = property(lambda self: self._options.get("db", 0), doc="The database number (``?db=`` over the path).")
    username = property(lambda self: self._options.get("username"), doc="The URL's user name, or None.")
    password = property(lambda self: self._options.get("password"), doc="The URL's password, or None; a secret.")
    secret = property(lambda self: self._text, doc="The URL as given, password included: for the client only.")
    tls = property(lambda self: self.scheme == "rediss", doc="True for ``rediss://``.")
    redacted = property(lambda self: redact(self._text), doc="The URL with its secrets as ``***`` (:func:`redact`).")

    def __str__(self) -> str:
        return self.redacted

    def __repr__(self) -> str:
        return f"RemoteURL({self.redacted!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteURL) and other.secret == self.secret

    def __hash__(self) -> int:
        return hash(self.secret)


def credentials(url: RemoteURL, environ=None) -> tuple[str | None, str | None]:
    """``(username, password)``: the URL's own, else ``EDGESYNC_REMOTE_USERNAME`` /
    ``EDGESYNC_REMOTE_PASSWORD`` from ``environ`` (default ``os.environ``), else None."""
    environ = os.environ if environ is None else environ
    user = url.username or environ.get(USERNAME_ENV) or None
    password = url.password or environ.get(PASSWORD_ENV) or None
    return user, password


def check_prefix(prefix: object) -> str | None:
    """None when ``prefix`` is a usable key prefix (:data:`PREFIX_PATTERN`), else what is wrong."""
    if isinstance(prefix, str) and PREFIX_PATTERN.fullmatch(prefix):
        return None
    return (f"must be 1 to 64 letters, digits or _ . - (no ':', which separates the prefix from the rest of "
            f"every key, and no braces, spaces or *), got {prefix!r}")
