"""The remote tier's key layout and its operations, one redis-py pipeline (one round trip) each.

Keys (``P`` = the deployment's prefix, ``EDGESYNC_REMOTE_PREFIX``; ``K`` = the 64 hex digits
of a store key, ``schema.store_key``; a Redis Cluster hash tag ``{K}`` keeps a fragment's two
keys on one node)::

    P:{K}:b              string  the fragment's blob, exactly core/codec.py's bytes
                                 EXPIRE: the fragment's lifetime tier (short: what is left of
                                 it; long or document: the long lifetime, renewed on hits)
    P:{K}:n              string  hits counted by every node (INCRBY), same EXPIRE as the blob
    P:i:<ns><prefix>     hash    the prefix index: field = store key (32 raw bytes), value =
                                 the blob's head (codec: magic, version, header JSON, token
                                 IDs, embedding, head CRC; no tensors), so a walk reads
                                 headers without blobs; <ns> and <prefix> are the hex of the
                                 namespace digest and the prefix hash (as LMDB's by_prefix)
                                 EXPIRE: the long lifetime, renewed by every write
    P:ns                 hash    namespace digest (32 raw bytes) -> its JSON (``to_dict``)

An index field can outlive its blob (Redis expired or evicted the blob): walks check that the
blobs exist and drop such fields. Every command used is listed in :data:`COMMANDS` (the
README's ACL user grants exactly these).
"""

from __future__ import annotations

import json
from typing import Sequence

from edgesync_store.core import codec
from edgesync_store.core.codec import FragmentHeader
from edgesync_store.errors import CodecError
from edgesync_store.schema import Namespace

COMMANDS = ("get", "set", "exists", "pttl", "incrby", "expire", "pexpire", "unlink", "hgetall", "hset", "hsetnx",
            "hdel", "scan")
"""Redis commands the tier sends (``scan`` only for ``edgesync clear --remote``)."""
CLUSTER_COMMANDS = ("cluster|slots", "cluster|shards", "command")
"""What a Redis Cluster client sends besides: redis-py reads the slot map and the command table."""

__all__ = ["CLUSTER_COMMANDS", "COMMANDS", "KeyLayout", "head_of", "parse_head"]


def head_of(blob: bytes) -> bytes:
    """The head of a codec blob: everything before the compressed tensors (header, token IDs,
    embedding and the head's CRC), a valid input of ``codec.peek``.

    Raises:
        CodecError: the blob's head does not parse.
    """
    head = codec.peek(blob)
    end = len(blob) - head.payload_nbytes - 4  # the payload and its CRC32 follow the head
    if end <= 0:
        raise CodecError("blob: payload_nbytes does not fit the blob")
    return bytes(blob[:end])


def parse_head(value: bytes) -> FragmentHeader | None:
    """``codec.peek`` of an index value, None when it does not parse (checksum, fields)."""
    try:
        return codec.peek(value)
    except CodecError:
        return None


class KeyLayout:
    """Key names under one prefix (module docstring) and the operations on them.

    Every operation takes the redis-py client to use (``RemoteClient.call`` supplies it) and
    returns plain values; redis-py's errors propagate to that call, which counts them.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

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
        return [dict(r or {}) for r in pipe.execute()]

    def alive(self, client, keys: Sequence[bytes]) -> list[bool]:
        """Whether each fragment's blob exists (not expired, not evicted), in one pipeline."""
        if not keys:
            return []
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.blob_key(key))
        return [bool(r) for r in pipe.execute()]

    def fetch(self, client, key: bytes) -> tuple[bytes | None, int, int]:
        """``(blob or None, remote hit count, milliseconds left to live)`` of one fragment; the
        time is -1 for a blob without expiry, -2 when absent."""
        pipe = client.pipeline(transaction=False)
        pipe.get(self.blob_key(key))
        pipe.get(self.hits_key(key))
        pipe.pttl(self.blob_key(key))
        blob, hits, pttl = pipe.execute()
        return blob, int(hits or 0), int(pttl)

    def namespaces(self, client) -> list[Namespace]:
        """The namespaces recorded by writers (ones that do not parse are skipped)."""
        found = []
        for digest, text in (client.hgetall(self.namespaces_key) or {}).items():
            try:
                ns = Namespace.from_dict(json.loads(text))
            except (ValueError, TypeError):
                continue
            if ns.digest() == bytes(digest):
                found.append(ns)
        return found

    # -- writes ---------------------------------------------------------------------------------

    def exists(self, client, key: bytes) -> bool:
        """True when the fragment's blob is stored."""
        return bool(client.exists(self.blob_key(key)))

    def put(self, client, key: bytes, blob: bytes, head: FragmentHeader, head_bytes: bytes, ttl_s: int,
            index_ttl_s: int) -> bool:
        """Store a fragment unless its blob is there (``SET NX``): blob with ``ttl_s`` seconds to
        live, its index field (the index hash's expiry set to ``index_ttl_s``) and its
        namespace. True when the blob was written.

        Raises:
            redis.ResponseError: ``OOM`` when the server is full (``noeviction``).
        """
        ikey = self.index_key(head.namespace.digest(), head.prefix_hash)
        pipe = client.pipeline(transaction=False)
        pipe.set(self.blob_key(key), blob, ex=max(1, int(ttl_s)), nx=True)
        pipe.hset(ikey, key, head_bytes)
        pipe.expire(ikey, max(1, int(index_ttl_s)))
        pipe.hsetnx(self.namespaces_key, head.namespace.digest(),
                    json.dumps(head.namespace.to_dict(), sort_keys=True, separators=(",", ":")))
        return bool(pipe.execute()[0])

    def add_hits(self, client, keys: Sequence[bytes], ttl_s: float, long_ttl_s: float, promote_hits: int) -> int:
        """Count one hit on each stored fragment of ``keys``; a fragment whose summed hits reach
        ``promote_hits``, or that is long-lived already (more than ``ttl_s`` left), gets
        ``long_ttl_s`` seconds to live again (blob and counter); a short-lived one keeps its
        expiry (the counter follows it). Two pipelines. Returns the hits counted."""
        if not keys:
            return 0
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.incr(self.hits_key(key))
            pipe.pttl(self.blob_key(key))
        replies = pipe.execute()
        pipe = client.pipeline(transaction=False)
        counted = 0
        for key, hits, pttl in zip(keys, replies[0::2], replies[1::2]):
            if pttl == -2:  # no blob: the counter must not linger alone
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

    def clear(self, client, batch: int = 500) -> int:
        """Remove every key under the prefix (``SCAN`` on every node, then ``UNLINK``); returns
        the keys removed. Keys of other prefixes are untouched."""
        removed, todo = 0, []
        for name in client.scan_iter(match=f"{self.prefix}:*", count=1000):
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
