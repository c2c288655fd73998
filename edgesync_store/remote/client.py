"""The connection to the remote tier: a *fast* redis-py client (reads before the first token,
``remote_timeout_ms``) and a *slow* one (writes, commands; ``remote_write_timeout_ms``), neither
retrying, each behind a circuit breaker; failures counted by kind, logged once per kind at WARNING,
naming the server by its redacted URL only. Behaviour under faults: docs/remote.md.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, TypeVar

from edgesync_store.errors import require_extra

redis = require_extra("redis", "remote", "the remote tier")
from redis.backoff import NoBackoff  # noqa: E402 (after the one-line refusal when redis is missing)
from redis.cluster import RedisCluster  # noqa: E402
from redis.exceptions import OutOfMemoryError, RedisClusterException  # noqa: E402
from redis.retry import Retry  # noqa: E402

from edgesync_store.remote.tier import FetchBudgetSpent  # noqa: E402
from edgesync_store.remote.url import RemoteURL, check_prefix, credentials  # noqa: E402

log = logging.getLogger(__name__)
T = TypeVar("T")

FAILURES_TO_OPEN = 3
"""Consecutive failed calls that open the breaker."""
MAX_RETRY_FACTOR = 8
"""The open breaker's wait grows to at most this many times ``retry_s``."""

__all__ = ["CircuitBreaker", "FAILURES_TO_OPEN", "RemoteClient", "RemoteCounters", "RemoteUnavailable"]


class RemoteUnavailable(Exception):
    """A remote call was skipped (breaker open) or failed; ``kind`` is one of ``skipped``,
    ``timeout``, ``connection``, ``oom``, ``other``. Never crosses the storage seam."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class RemoteCounters:
    """What the remote tier did since the backend opened (counts; bytes).

    Attributes:
        walks, walk_gains, walk_splits: walks over both tiers (the local one fell short), those
            that reached further, and those whose chain took spans from both tiers.
        hits, bytes_fetched: fragments fetched, verified and served; their compressed bytes.
        misses: fragments the remote walk offered that were gone when fetched.
        corrupt: remote blobs or index entries refused (checksum, content hash, key).
        puts, bytes_written: fragments the background writer wrote; their compressed bytes.
        hits_recorded, deletes: hit counts added; fragments removed (forget, corrupt).
        queue_drops, write_skips: write-behind jobs dropped (queue full) or not sent (remote down).
        timeout, connection, oom, other: failed calls by kind.
        skipped, breaker_opens: calls skipped by the open breaker; times it opened.
        bad_values: remote values of the wrong type or form, skipped and deleted.
    """

    walks: int = 0
    walk_gains: int = 0
    walk_splits: int = 0
    hits: int = 0
    bytes_fetched: int = 0
    misses: int = 0
    corrupt: int = 0
    puts: int = 0
    bytes_written: int = 0
    hits_recorded: int = 0
    deletes: int = 0
    queue_drops: int = 0
    write_skips: int = 0
    timeout: int = 0
    connection: int = 0
    oom: int = 0
    other: int = 0
    skipped: int = 0
    breaker_opens: int = 0
    bad_values: int = 0

    @property
    def errors(self) -> int:
        """Failed calls of every kind (skipped calls excluded)."""
        return self.timeout + self.connection + self.oom + self.other

    def to_dict(self) -> dict:
        """Every counter by name, plus ``errors``."""
        return {**asdict(self), "errors": self.errors}


class CircuitBreaker:
    """Closed (calls go through), open (skipped), half-open (one probe). Thread-safe. Opens after
    ``FAILURES_TO_OPEN`` failures in a row; ``retry_s``: seconds open before a probe (doubling per
    failed probe, up to ``MAX_RETRY_FACTOR`` times); ``clock``: monotonic seconds.
    """

    def __init__(self, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s = float(retry_s)
        self.clock = clock
        self.failures = 0
        self.open_until: float | None = None
        self.wait_s = self.retry_s
        self.lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        """True while calls are being skipped."""
        with self.lock:
            return self.open_until is not None and self.clock() < self.open_until

    def allow(self) -> bool:
        """True when a call may go out now (closed, or the wait is over: a probe)."""
        with self.lock:
            return self.open_until is None or self.clock() >= self.open_until

    def success(self) -> bool:
        """Record a success; True when it closed an open breaker."""
        with self.lock:
            was_open = self.open_until is not None
            self.failures, self.open_until, self.wait_s = 0, None, self.retry_s
            return was_open

    def failure(self, at_once: bool = False) -> bool:
        """Record a failure (``at_once``: open now); True when this opened the breaker."""
        with self.lock:
            self.failures += 1
            if self.open_until is not None:  # a failed probe: wait longer
                self.wait_s = min(self.wait_s * 2, self.retry_s * MAX_RETRY_FACTOR)
                self.open_until = self.clock() + self.wait_s
                return False
            if at_once or self.failures >= FAILURES_TO_OPEN:
                self.open_until = self.clock() + self.wait_s
                return True
            return False


CLIENT_ERRORS = (redis.RedisError, RedisClusterException, OSError)
"""What a redis-py call may raise (a cluster's setup errors are not ``RedisError``s)."""
REPLY_ERRORS = (ValueError, TypeError, LookupError, AttributeError)
"""What using a reply of an unexpected form may raise: counted as ``other``, never raised."""


def _classify(exc: Exception) -> str:
    if isinstance(exc, (redis.TimeoutError, TimeoutError)):  # TimeoutError: tier.FetchBudgetSpent
        return "timeout"
    if isinstance(exc, redis.ConnectionError):
        return "connection"
    if isinstance(exc, OutOfMemoryError) or (isinstance(exc, redis.ResponseError) and str(exc).startswith("OOM")):
        return "oom"
    return "other"


URL_OPTIONS = frozenset({"db", "username", "password", "client_name", "socket_keepalive", "socket_read_size",
                         "max_connections"})
"""Query arguments of the URL passed on to redis-py (its own parsers check their values)."""
TLS_OPTIONS = frozenset({"ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_password",
                         "ssl_check_hostname", "ssl_min_version", "ssl_ciphers", "ssl_include_verify_flags",
                         "ssl_exclude_verify_flags"})
"""Query arguments passed on for ``rediss://`` only (redis-py's ``SSLConnection``)."""
FIXED_OPTIONS = frozenset({"socket_timeout", "socket_connect_timeout", "timeout", "retry_on_timeout", "retry_on_error",
                           "health_check_interval", "decode_responses", "encoding", "protocol"})
"""Query arguments the tier sets itself (timeouts, no retries, binary RESP2), never taken from a URL."""


def check_options(url: RemoteURL, cluster: bool = False) -> str | None:
    """None when the tier can use ``url``'s query arguments, else what is wrong (redacted): one not
    in :data:`URL_OPTIONS` (or :data:`TLS_OPTIONS` for ``rediss://``), one in :data:`FIXED_OPTIONS`,
    a database other than 0 on a cluster."""
    from urllib.parse import parse_qsl, urlsplit

    shown = url.redacted
    visible = {name for name, _ in parse_qsl(urlsplit(shown).query, keep_blank_values=True)}
    for name, _value in parse_qsl(urlsplit(url.secret).query, keep_blank_values=True):
        if name in FIXED_OPTIONS:
            how = ("EDGESYNC_REMOTE_TIMEOUT_MS and EDGESYNC_REMOTE_WRITE_TIMEOUT_MS set the timeouts"
                   if "timeout" in name else "the remote tier sets it")
            return f"{shown}: {name}= is not taken from the URL ({how})"
        if name in TLS_OPTIONS and not url.tls:
            return f"{shown}: {name}= needs rediss:// (TLS)"
        if name not in URL_OPTIONS | TLS_OPTIONS:
            # a name the redaction hid (after password=) may be the tail of a password typed with '&'
            label = f"{name[:40]}=" if name in visible else "an argument after password= (hidden)"
            return (f"{shown}: {label} is not an option the remote tier passes on (it takes "
                    f"{', '.join(sorted(URL_OPTIONS | (TLS_OPTIONS if url.tls else set())))})")
    if cluster and url.db != 0:
        return f"{shown}: a Redis Cluster has database 0 only, the URL names {url.db}"
    return None


def _hint(exc: Exception) -> str:
    """What to check when a failure is the configuration's, not the network's ("" otherwise)."""
    text = str(exc)
    if isinstance(exc, redis.AuthenticationError) or text.startswith(("WRONGPASS", "NOAUTH", "invalid username")):
        return " (check the user and password: EDGESYNC_REMOTE_URL, EDGESYNC_REMOTE_USERNAME/PASSWORD)"
    if "DB index is out of range" in text or "Invalid Database" in text:
        return " (the server has fewer databases than the remote URL's number: EDGESYNC_REMOTE_URL)"
    if text.startswith("NOPERM"):
        return " (the ACL user lacks a command or key pattern: see tier.COMMANDS and the key prefix)"
    return ""


def _make_client(url: RemoteURL, cluster: bool, timeout_s: float):
    """A redis-py client for ``url``: no retries, no CLIENT SETINFO, binary replies."""
    user, password = credentials(url)
    common = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                  decode_responses=False, driver_info=None, username=user, password=password)
    if cluster:
        # from_url parses host, port, TLS and query arguments; one reachable node is enough
        return RedisCluster.from_url(url.secret, require_full_coverage=True, **common)
    return redis.Redis.from_url(url.secret, health_check_interval=0, **common)


class RemoteClient:
    """The remote tier's clients, breakers and counters. Connecting is lazy: opening never fails
    for an unreachable remote; its first calls fail and count.

    Args:
        url: the server (any node of a cluster).
        timeout_ms: the fast client's socket read and connect timeout, ms (redis-py's ``socket_timeout``).
        write_timeout_ms: the same for the slow client.
        retry_s: seconds the open breaker waits before probing again.
    """

    def __init__(self, url: RemoteURL, cluster: bool = False, timeout_ms: float = 50.0,
                 write_timeout_ms: float = 2000.0, retry_s: float = 5.0) -> None:
        self.url = url if isinstance(url, RemoteURL) else RemoteURL(url)
        self.cluster = cluster
        self.timeouts_s = {"fast": timeout_ms / 1000.0, "slow": write_timeout_ms / 1000.0}
        # one breaker per client: a remote too slow for the request path's budget may still take
        # the background writes, and their successes must not keep the request path waiting
        self.breakers = {"fast": CircuitBreaker(retry_s), "slow": CircuitBreaker(retry_s)}
        self.counters = RemoteCounters()
        self.counters_lock = threading.Lock()
        self._clients: dict[str, object] = {}
        self._clients_lock = threading.Lock()
        self._noted: set[str] = set()

    def __repr__(self) -> str:
        return f"RemoteClient({self.url.redacted!r}, cluster={self.cluster})"

    @property
    def breaker(self) -> CircuitBreaker:
        """The request path's (fast client's) breaker."""
        return self.breakers["fast"]

    def client(self, which: str):
        """The ``"fast"`` or ``"slow"`` redis-py client, made on first use. Raises
        RemoteUnavailable when it cannot be made (a cluster whose nodes do not answer)."""
        with self._clients_lock:
            if which not in self._clients:
                try:
                    self._clients[which] = _make_client(self.url, self.cluster, self.timeouts_s[which])
                except CLIENT_ERRORS as exc:
                    raise RemoteUnavailable(_classify(exc), f"{self.url.redacted}: {exc}{_hint(exc)}") from None
                except (ValueError, TypeError) as exc:  # redis-py refused the URL's options
                    raise RemoteUnavailable("other", f"{self.url.redacted}: {exc} (check the remote URL, "
                                                     "EDGESYNC_REMOTE_URL)") from None
            return self._clients[which]

    def count(self, **deltas: int) -> None:
        """Add ``deltas`` to the named counters."""
        with self.counters_lock:
            for name, n in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + n)

    def call(self, which: str, op: Callable[[object], T], what: str) -> T:
        """``op(client)`` on the ``which`` client through the breaker; ``what`` names it in logs.
        Raises RemoteUnavailable when the breaker is open (``skipped``) or the call failed."""
        breaker = self.breakers[which]
        if not breaker.allow():
            self.count(skipped=1)
            raise RemoteUnavailable("skipped", f"remote {self.url.redacted} unavailable (circuit open)")
        try:
            result = op(self.client(which))
        except RemoteUnavailable as exc:
            self._failed(breaker, exc.kind, what, str(exc))
            raise
        except CLIENT_ERRORS as exc:
            kind, detail = _classify(exc), f"{exc}{_hint(exc)}"
            # a fetch over its whole budget: the remote is too slow for the request path now, and
            # the request's walk again (execute.py) must not try it a second time
            self._failed(breaker, kind, what, detail, at_once=isinstance(exc, FetchBudgetSpent))
            raise RemoteUnavailable(kind, f"remote {what} failed ({kind}): {detail}") from None
        except REPLY_ERRORS as exc:  # a reply of an unexpected form, or an option redis-py refused late
            detail = (f"{type(exc).__name__}: {exc} (a reply of an unexpected form, or an option of the remote URL, "
                      "EDGESYNC_REMOTE_URL)")
            self._failed(breaker, "other", what, detail)
            raise RemoteUnavailable("other", f"remote {what} failed (other): {detail}") from None
        if breaker.success():
            log.info("remote tier %s answers again (%s); circuit closed", self.url.redacted, what)
        return result

    def _failed(self, breaker: CircuitBreaker, kind: str, what: str, detail: str, at_once: bool = False) -> None:
        """Count and log a failed call (``at_once``: open the breaker now)."""
        self.count(**{kind: 1})
        with self.counters_lock:
            n = getattr(self.counters, kind)
        if kind == "oom":  # the server is full, not gone: reads still work, the breaker stays closed
            self.note("failure:oom", "remote tier %s is full (maxmemory, noeviction): %s not stored (%d refused so "
                      "far; counted as oom, repeats logged at DEBUG)", self.url.redacted, what, n)
            return
        if breaker.failure(at_once):
            self.count(breaker_opens=1)
            log.warning("remote tier %s: %d failed calls in a row (last: %s %s%s); %s local-only, retrying in %.1f s",
                        self.url.redacted, breaker.failures, what, kind, f": {detail}" if at_once else "",
                        "serving" if breaker is self.breaker else "writing", breaker.wait_s)
        else:
            self.note(f"failure:{kind}", "remote tier %s: %s failed (%s: %s); going on without it (%d %s failures "
                      "so far, repeats logged at DEBUG)", self.url.redacted, what, kind, detail, n, kind)

    def note(self, kind: str, message: str, *args: object) -> None:
        """Log ``message % args`` at WARNING the first time for ``kind``, at DEBUG after."""
        with self.counters_lock:
            first = kind not in self._noted
            self._noted.add(kind)
        log.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def close(self) -> None:
        """Close both clients' connections (idempotent)."""
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            try:
                c.close()
            except CLIENT_ERRORS as exc:
                log.debug("closing a remote client: %s", exc)


def checked_target(url: "RemoteURL | str", prefix: str, cluster: bool = False) -> RemoteURL:
    """``url`` parsed and, with ``prefix``, checked (:func:`check_prefix`, :func:`check_options`).
    Raises ValueError (redacted) for a bad URL, query argument or key prefix."""

    try:
        url = url if isinstance(url, RemoteURL) else RemoteURL(url)
    except ValueError as exc:  # its message shows the URL redacted
        raise ValueError(f"remote URL: {exc}") from None
    problem = check_prefix(prefix)
    if problem:
        raise ValueError(f"remote prefix: {problem}")
    problem = check_options(url, cluster)
    if problem:
        raise ValueError(f"remote URL: {problem}")
    return url
