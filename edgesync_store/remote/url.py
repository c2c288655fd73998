"""The remote tier's address: a ``redis://`` or ``rediss://`` URL whose secret never shows.

:class:`RemoteURL` holds the URL a deployment gives (``EDGESYNC_REMOTE_URL``); its ``str()``,
``repr()`` and :attr:`RemoteURL.redacted` print the password (and a ``password=`` query
argument) as ``***``, so that a config's repr, a log line or an error message never carries
it. Only :attr:`RemoteURL.secret` gives the URL as typed, for the client that connects. The
redaction (:func:`redact`) is textual and comes before any parsing, so that a URL no parser
reads as meant (a password with ``/``, ``?`` or ``#`` typed as it is) is hidden as well.

The username and password may also come from the environment, ``EDGESYNC_REMOTE_USERNAME``
and ``EDGESYNC_REMOTE_PASSWORD`` (:func:`credentials`), so that the URL itself can be logged
and checked into a deployment's config. The URL's own user and password win over them.

This module imports no client library: the settings table (``edgesync_engines.config``)
validates the URL with it.
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qsl, unquote, urlsplit

SCHEMES = ("redis", "rediss")
"""``redis``: plain TCP; ``rediss``: TLS (redis-py's own URL schemes)."""
USERNAME_ENV = "EDGESYNC_REMOTE_USERNAME"
PASSWORD_ENV = "EDGESYNC_REMOTE_PASSWORD"
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A key prefix (the whole string): 1 to 64 letters, digits, ``_ . -``. Every key is
``PREFIX:...``, so no ``:`` (a prefix ``shop`` would otherwise own the keys of ``shop:17``,
and ``clear --remote`` of one would remove the other's); no braces (they would become a Redis
Cluster hash tag), no spaces or glob characters (``clear`` scans ``PREFIX:*``)."""

__all__ = ["MAX_DB", "PASSWORD_ENV", "PREFIX_PATTERN", "RemoteURL", "SCHEMES", "UNSAFE_IN_USERINFO", "USERNAME_ENV",
           "check_prefix", "credentials", "redact"]


MAX_DB = 2**31 - 1
"""The largest database number Redis's ``SELECT`` takes (a C ``int``; the server's ``databases``
setting, 16 by default, bounds it further: a number above is refused on the first call)."""
UNSAFE_IN_USERINFO = "/?#"
"""Characters that end a URL's user and password part (RFC 3986): typed as they are in a password
they make every URL parser (urllib's, so redis-py's) read the rest as a path, query or fragment.
Percent-encoded (``%2F``, ``%3F``, ``%23``) they are fine."""
_SHOWN_USER = re.compile(r"^[A-Za-z0-9._~%!$&'()*+,;=-]*$")
"""A user name shown in a redacted URL: RFC 3986's user characters, nothing that could be the
start of a mistyped password."""


def redact(text: str) -> str:
    """``text`` with everything between ``://`` and the last ``@`` (the whole text before the
    last ``@`` when there is no ``://``) replaced by ``user:***`` (the user name kept only when it
    is plainly one, else ``***``), and everything after a ``password=`` query argument's ``=`` by
    ``***`` (the arguments after it too: an unencoded ``&`` in the password would end it early).

    Purely textual, so it holds for a URL no parser reads as intended (a password with ``/``,
    ``?``, ``#`` or ``@`` typed as it is): every message about a URL shows it through this.
    """
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

    Args:
        text: the URL as given.

    Raises:
        ValueError: not a string, another scheme, no host, a port or db (the path, or ``db=``)
            that is not a number, a db above :data:`MAX_DB`, a user or password with an
            unencoded ``/``, ``?`` or ``#``; the message shows the URL
            through :func:`redact` only (never a part a parser cut out of it, which could hold
            the tail of a mistyped password).
    """

    __slots__ = ("_text", "scheme", "host", "port", "db")

    def __init__(self, text: str) -> None:
        if isinstance(text, RemoteURL):
            text = text.secret
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"must be a redis:// or rediss:// URL, got {type(text).__name__}")
        self._text = text.strip()
        shown = self.redacted
        scheme_end = self._text.find("://")
        if self._text.rfind("@") > scheme_end >= 0 and any(
                c in self._text[scheme_end + 3:self._text.rfind("@")] for c in UNSAFE_IN_USERINFO):
            raise ValueError(f"{shown}: the user name or password holds '/', '?' or '#' as typed: percent-encode "
                             "them (%2F, %3F, %23; '@' as %40, '%' as %25; an '@' in the path or query as %40)")
        try:
            parts = urlsplit(self._text)
            port = parts.port
        except ValueError:
            raise ValueError(f"{shown}: not a URL (bad host or port)") from None
        if parts.scheme not in SCHEMES:
            raise ValueError(f"{shown}: the scheme must be redis:// or rediss:// (TLS)")
        if not parts.hostname:
            raise ValueError(f"{shown}: no host")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"{shown}: the path must be a database number (/0, /1, ...)")
        query_db = dict(parse_qsl(parts.query)).get("db")
        if query_db is not None and not query_db.isdigit():  # redis-py takes ?db= over the path
            raise ValueError(f"{shown}: db= must be a database number (0, 1, ...)")
        db = int(query_db if query_db is not None else db or 0)
        if db > MAX_DB:
            raise ValueError(f"{shown}: database {db} is out of range (0 to {MAX_DB})")
        self.scheme, self.host, self.port, self.db = parts.scheme, parts.hostname, port or 6379, db

    @property
    def secret(self) -> str:
        """The URL as given, password included: for the client only, never for a log line."""
        return self._text

    @property
    def tls(self) -> bool:
        """True for ``rediss://``."""
        return self.scheme == "rediss"

    @property
    def username(self) -> str | None:
        """The URL's user name (None: none given)."""
        name = urlsplit(self._text).username
        return unquote(name) if name else None

    @property
    def password(self) -> str | None:
        """The URL's password (None: none given); a secret."""
        parts = urlsplit(self._text)
        if parts.password is not None:
            return unquote(parts.password)
        query = dict(parse_qsl(parts.query))
        return query.get("password")

    @property
    def redacted(self) -> str:
        """The URL with its password (and a ``password=`` query value) replaced by ``***``
        (:func:`redact`)."""
        return redact(self._text)

    def __str__(self) -> str:
        return self.redacted

    def __repr__(self) -> str:
        return f"RemoteURL({self.redacted!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteURL) and other.secret == self.secret

    def __hash__(self) -> int:
        return hash(self.secret)


def credentials(url: RemoteURL, environ=None) -> tuple[str | None, str | None]:
    """``(username, password)`` for ``url``: the URL's own, else ``EDGESYNC_REMOTE_USERNAME`` and
    ``EDGESYNC_REMOTE_PASSWORD`` from ``environ`` (default ``os.environ``); None when neither
    gives one."""
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
