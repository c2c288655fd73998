"""The remote tier's key layout and its operations, one redis-py pipeline (round trip) each.

Keys (``P`` the prefix, holding no ``:``; ``K`` the 64 hex digits of a store key; the hash tag
``{K}`` keeps a fragment's keys on one cluster node)::

    P:{K}:b           string  the blob, exactly core/codec.py's bytes; EXPIRE the lifetime left
    P:{K}:n           string  hits counted by every node (INCRBY), same EXPIRE as the blob
    P:i:<ns><prefix>  hash    store key (32 raw bytes) -> the blob's head (no tensors); <ns>,
                              <prefix>: hex of namespace digest and prefix hash; EXPIRE long
    P:ns              hash    namespace digest (32 raw bytes) -> its JSON (``to_dict``)

Every command used is in :data:`COMMANDS`. Every reply is validated: a value of the wrong type or
form is skipped as absent and reported to :attr:`KeyLayout.on_bad`, never failing the operation.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from edgesync_store.core import codec
from edgesync_store.core.codec import FragmentHeader, head_of
from edgesync_store.errors import CodecError
from edgesync_store.remote.url import check_prefix
from edgesync_store.schema import Namespace

log = logging.getLogger(__name__)

COMMANDS = ("get", "getrange", "strlen", "set", "exists", "pttl", "incrby", "expire", "pexpire", "unlink", "hgetall",
            "hset", "hsetnx", "hdel", "scan")
"""Redis commands the tier sends (``scan`` only for ``edgesync clear --remote``)."""
CLUSTER_COMMANDS = ("cluster|slots", "cluster|shards", "command")
"""What a Redis Cluster client sends besides: redis-py reads the slot map and the command table."""

__all__ = ["CLUSTER_COMMANDS", "COMMANDS", "FETCH_CHUNK", "FetchBudgetSpent", "Fetched", "KeyLayout", "head_of",
           "parse_count", "parse_head"]

FETCH_CHUNK = 128 * 1024
"""Bytes of a blob read per round trip (``GETRANGE``); the fetch deadline is checked between
chunks (docs/measurements.md)."""


class FetchBudgetSpent(TimeoutError):
    """A fetch's deadline passed before its blob was read whole (``RemoteClient`` counts it as a ``timeout``)."""


_COUNT = re.compile(rb"[0-9]{1,19}")
MAX_COUNT = 2**63 - 1
"""Redis counters are signed 64-bit integers (``INCRBY``'s range)."""
BadValue = Callable[[str, str], None]
"""``(key name, what is wrong)``: a reply that cannot be used (see the module docstring)."""


def parse_count(value: object) -> int | None:
    """A hit counter's value as ``GET`` returns it (ASCII decimal bytes, as ``INCRBY`` keeps
    them) as an int in ``[0, 2**63 - 1]``; None for anything else (signs, spaces, text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 <= value <= MAX_COUNT else None
    if isinstance(value, (bytes, bytearray)) and _COUNT.fullmatch(value):
        n = int(value)
        return n if n <= MAX_COUNT else None
    return None


def _pttl(value: object) -> int | None:
    """A ``PTTL`` reply: milliseconds >= 0, -1 (no expiry) or -2 (absent); None otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= -2:
        return value
    return None


VALUE_ERRORS = ("WRONGTYPE", "value is not an integer", "increment or decrement would overflow")
"""Starts of Redis error replies (without ``ERR ``) that blame the value under the key; other
error replies (``OOM``, ``NOPERM``, ...) are raised by :func:`_checked`."""


def _value_fault(reply: object) -> bool:
    """True for an error reply caused by the value under the key (:data:`VALUE_ERRORS`)."""
    return isinstance(reply, Exception) and str(reply).startswith(VALUE_ERRORS)


def _checked(replies: list) -> list:
    """``replies`` of ``execute(raise_on_error=False)``; an error other than ``WRONGTYPE`` raised."""
    for reply in replies:
        if isinstance(reply, Exception) and not _value_fault(reply):
            raise reply
    return replies


@dataclass(frozen=True)
class Fetched:
    """One fragment as :meth:`KeyLayout.fetch` read it: ``blob`` (unverified bytes, or None),
    ``hits`` (summed; 0 when absent or unusable), ``pttl_ms`` (ms left; -1 no expiry, -2 absent)."""

    blob: bytes | None
    hits: int
    pttl_ms: int


def parse_head(value: bytes) -> FragmentHeader | None:
    """``codec.peek`` of an index value, None when it does not parse (checksum, fields)."""
    try:
        return codec.peek(value)
    except CodecError:
        return None


class KeyLayout:
    """Key names under one prefix and the operations on them. Each takes the redis-py client
    (``RemoteClient.call`` supplies it); redis-py's errors propagate to that call.

    Args:
        prefix: the deployment's key prefix (``url.check_prefix``; ValueError otherwise).
        on_bad: told of every unusable value met; default: logged here.
    """

    def __init__(self, prefix: str, on_bad: BadValue | None = None) -> None:
        problem = check_prefix(prefix)
        if problem:
            raise ValueError(f"remote prefix: {problem}")
        self.prefix = prefix
        # exactly the names below; a prefix has no ':' (url.check_prefix), so none of another's
        self._own = re.compile(re.escape(prefix) + r":(?:\{[0-9a-f]{64}\}:[bn]|i:[0-9a-f]{128}|ns)")
        self.on_bad: BadValue = on_bad or (lambda name, why: log.warning("remote key %s: %s", name, why))

    def blob_key(self, key: bytes) -> str:
        return f"{self.prefix}:{{{key.hex()}}}:b"

    def hits_key(self, key: bytes) -> str:
        return f"{self.prefix}:{{{key.hex()}}}:n"

    def index_key(self, ns_digest: bytes, prefix_hash: bytes) -> str:
        return f"{self.prefix}:i:{ns_digest.hex()}{prefix_hash.hex()}"

    @property
    def namespaces_key(self) -> str:
        return f"{self.prefix}:ns"

    # -- reads ----------------------------------------------------------------------------------

    def index_entries(self, client, index_keys: Sequence[str]) -> list[dict[bytes, bytes]]:
        """The index hash of each of ``index_keys`` ({store key: head}), in one pipeline."""
        pipe = client.pipeline(transaction=False)
        for ikey in index_keys:
            pipe.hgetall(ikey)
        out = []
        for ikey, reply in zip(index_keys, _checked(pipe.execute(raise_on_error=False))):
            if _value_fault(reply) or not isinstance(reply, (dict, type(None))):
                self.on_bad(ikey, "not a hash (an index entry must be one); skipped")
                reply = None
            out.append(dict(reply or {}))
        return out

    def alive(self, client, keys: Sequence[bytes]) -> list[bool]:
        """Whether each fragment's blob exists (not expired, not evicted), in one pipeline."""
        if not keys:
            return []
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.blob_key(key))
        return [bool(r) for r in pipe.execute()]

    def fetch(self, client, key: bytes, deadline: float | None = None, chunk: int = FETCH_CHUNK,
              clock: Callable[[], float] = time.monotonic) -> Fetched:
        """One fragment's blob, summed hit count and time left, read ``chunk`` bytes per round trip;
        ``deadline`` (``clock()`` seconds) is checked before each further chunk. Unusable values and a
        blob deleted while read read as absent. Raises FetchBudgetSpent when ``deadline`` passes first.
        """
        bkey, nkey = self.blob_key(key), self.hits_key(key)
        pipe = client.pipeline(transaction=False)
        pipe.getrange(bkey, 0, chunk - 1)
        pipe.strlen(bkey)
        pipe.get(nkey)
        pipe.pttl(bkey)
        first, size, hits_reply, pttl_reply = _checked(pipe.execute(raise_on_error=False))
        hits = 0 if hits_reply is None else parse_count(hits_reply)
        if hits is None:
            shown = "another type" if isinstance(hits_reply, Exception) else repr(hits_reply)[:40]
            self.on_bad(nkey, f"hit counter holds {shown}, not a count; read as 0")
            hits = 0
        pttl = _pttl(pttl_reply)
        pttl = -2 if pttl is None else pttl
        if _value_fault(first) or not isinstance(first, (bytes, bytearray)) or not isinstance(size, int):
            self.on_bad(bkey, "not a string (a blob must be one); skipped")
            return Fetched(None, hits, pttl)
        parts, got = [bytes(first)], len(first)
        while got < size:
            if deadline is not None and clock() >= deadline:
                raise FetchBudgetSpent(f"fetch budget spent after {got:,} of {size:,} bytes of {bkey}")
            piece = client.getrange(bkey, got, min(got + chunk, size) - 1)
            if not isinstance(piece, (bytes, bytearray)) or not piece:
                return Fetched(None, hits, pttl)  # deleted (or replaced) while read: absent
            parts.append(bytes(piece))
            got += len(piece)
        return Fetched(b"".join(parts) if size and got == size else None, hits, pttl)

    def namespaces(self, client) -> list[Namespace]:
        """The namespaces recorded by writers (ones that do not parse are skipped)."""
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(self.namespaces_key)
        (reply,) = _checked(pipe.execute(raise_on_error=False))
        if _value_fault(reply) or not isinstance(reply, (dict, type(None))):
            self.on_bad(self.namespaces_key, "not a hash (the namespaces must be one); skipped")
            return []
        found = []
        for digest, text in (reply or {}).items():
            try:
                ns = Namespace.from_dict(json.loads(text))
                ok = ns.digest() == bytes(digest)
            except (ValueError, TypeError):
                ok = False
            if ok:
                found.append(ns)
            else:  # skipped, not deleted: another writer's field, which this code may not read
                log.debug("remote namespaces: field %s does not parse or match its digest; skipped",
                          bytes(digest)[:8].hex())
        return found

    # -- writes ---------------------------------------------------------------------------------

    def put(self, client, key: bytes, blob: bytes, head: FragmentHeader, head_bytes: bytes, ttl_s: int,
            index_ttl_s: int) -> bool:
        """Store a fragment: its blob unless present (``SET NX``, ``ttl_s`` seconds), then, once the blob
        is stored, its index field (hash expiry ``index_ttl_s``) and namespace. Up to three round trips
        (no transaction spans cluster nodes). True when the blob was written now. Raises
        redis.ResponseError ``OOM`` when the server is full (a refused blob leaves no index field)."""
        bkey = self.blob_key(key)
        wrote = False
        if not client.exists(bkey):
            # None: NX found it stored meanwhile by another writer; indexed all the same
            wrote = bool(client.set(bkey, blob, ex=max(1, int(ttl_s)), nx=True))
        ikey = self.index_key(head.namespace.digest(), head.prefix_hash)
        pipe = client.pipeline(transaction=False)
        pipe.hset(ikey, key, head_bytes)
        pipe.expire(ikey, max(1, int(index_ttl_s)))
        pipe.hsetnx(self.namespaces_key, head.namespace.digest(),
                    json.dumps(head.namespace.to_dict(), sort_keys=True, separators=(",", ":")))
        pipe.execute()
        return wrote

    def add_hits(self, client, keys: Sequence[bytes], ttl_s: float, long_ttl_s: float, promote_hits: int) -> int:
        """Count one hit on each stored fragment of ``keys``; one whose hits reach ``promote_hits``, or
        that is long-lived already, gets ``long_ttl_s`` seconds again. Two pipelines. Returns the hits
        counted (a counter ``INCR`` refuses goes to ``on_bad``, uncounted)."""
        if not keys:
            return 0
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.incr(self.hits_key(key))
            pipe.pttl(self.blob_key(key))
        replies = _checked(pipe.execute(raise_on_error=False))
        pipe = client.pipeline(transaction=False)
        counted = 0
        for key, hits, pttl in zip(keys, replies[0::2], replies[1::2]):
            if _value_fault(hits):  # on_bad deletes it; the next hit starts a new count
                self.on_bad(self.hits_key(key), "hit counter is not a count; this hit not counted")
                continue
            if pttl == -2 or _pttl(pttl) is None:  # no blob: the counter must not linger alone
                pipe.unlink(self.hits_key(key))
                continue
            counted += 1
            if hits >= promote_hits or pttl == -1 or pttl > ttl_s * 1000:
                pipe.expire(self.blob_key(key), int(long_ttl_s))
                pipe.expire(self.hits_key(key), int(long_ttl_s))
            else:
                pipe.pexpire(self.hits_key(key), pttl)
        pipe.execute()
        return counted

    def delete(self, client, keys: Sequence[bytes]) -> int:
        """Remove fragments' blobs and counters (their index fields are dropped by the next walk
        that meets them, or by :meth:`drop_index_fields`); returns blobs removed."""
        if not keys:
            return 0
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.unlink(self.blob_key(key))
            pipe.unlink(self.hits_key(key))
        return sum(int(r) for r in pipe.execute()[0::2])

    def drop_index_fields(self, client, entries: Sequence[tuple[str, bytes]]) -> None:
        """``HDEL`` each ``(index key, store key)`` of ``entries``."""
        if not entries:
            return
        pipe = client.pipeline(transaction=False)
        for ikey, key in entries:
            pipe.hdel(ikey, key)
        pipe.execute()

    def own(self, name: bytes | str) -> bool:
        """True when ``name`` is exactly one of this layout's keys (module docstring)."""

        text = name.decode("ascii", "replace") if isinstance(name, (bytes, bytearray)) else name
        return self._own.fullmatch(text) is not None

    def clear(self, client, batch: int = 500) -> int:
        """Remove every key of this layout (``SCAN`` of ``PREFIX:*`` on every node, each name checked by
        :meth:`own`, then ``UNLINK``); returns the keys removed."""
        removed, todo = 0, []
        for name in client.scan_iter(match=f"{self.prefix}:*", count=1000):
            if not self.own(name):
                continue
            todo.append(name)
            if len(todo) >= batch:
                removed += self._unlink(client, todo)
                todo = []
        return removed + self._unlink(client, todo)

    @staticmethod
    def _unlink(client, names: list) -> int:
        if not names:
            return 0
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.unlink(name)
        return sum(int(r) for r in pipe.execute())
