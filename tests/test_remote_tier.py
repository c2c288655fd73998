"""The remote tier against real redis-server processes (standalone and a 3-master cluster), with
fragments of SmolLM2's geometry from seeded random numbers: no model here (the request path's
tests are in test_remote_nodes.py).

Two ``TieredStore`` objects over separate local stores and one server stand for two nodes.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import redis

from edgesync_engines.config import EdgeSyncConfig
from edgesync_store.core import codec
from edgesync_store.remote.client import FAILURES_TO_OPEN
from edgesync_store.remote.queue import WriteBehind
from edgesync_store.remote.tier import CLUSTER_COMMANDS, COMMANDS
from edgesync_store.ttl import LIFETIME_LONG, TTLPolicy
from tests.fragments import SMOL
from tests.remote_support import chain, new_prefix, prompt, tiered
from tools.redis_servers import free_port

OTHER = SMOL.__class__(**{**SMOL.to_dict(), "model_fingerprint": "cd" * 32})


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def _share_one_prompt(tmp_path, url, prefix, cluster=False):
    """Node A stores a 200-token prompt's chain (3 fragments), its writes drained; node B, on an
    empty local store, walks and reads it. Returns (a, b, tokens, fragments, match)."""
    tokens = prompt(0)
    frags = chain(tokens)
    a = tiered(tmp_path, "a", url, prefix, cluster=cluster)
    b = tiered(tmp_path, "b", url, prefix, cluster=cluster)
    assert a.put_many(frags) == 3 and a.flush(30)
    assert a.remote_stats()["puts"] == 3
    assert b.local.prefix_walk(SMOL, tokens).matched_tokens == 0
    match = b.prefix_walk(SMOL, tokens)
    return a, b, tokens, frags, match


@pytest.mark.redis
@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_a_second_node_reads_what_the_first_stored(tmp_path, request, topology):
    server = request.getfixturevalue("redis_server" if topology == "standalone" else "redis_cluster")
    a, b, tokens, frags, match = _share_one_prompt(tmp_path, server.url, new_prefix(topology),
                                                   cluster=topology == "cluster")
    try:
        assert match.matched_tokens == 199 and [s.token_end for s in match.spans] == [64, 128, 199]
        got = [b.get(k) for s in match.spans for k in s.keys]
        for g, f in zip(got, frags):
            assert g.key() == f.key() and np.array_equal(g.keys, f.keys) and np.array_equal(g.values, f.values)
        stats = b.remote_stats()
        blobs = [codec.encode(f) for f in frags]
        assert stats["hits"] == 3 and stats["bytes_fetched"] == sum(len(x) for x in blobs)
        assert sum(s.compressed_nbytes for s in match.spans) == stats["bytes_fetched"]
        b.record_hits([k for s in match.spans for k in s.keys])
        # fetched fragments are now local, as the same bytes: the next walk costs no remote call
        assert [b.local.get_blob(f.key()) for f in frags] == blobs
        walks = b.remote_stats()["walks"]
        assert b.prefix_walk(SMOL, tokens).matched_tokens == 199 and b.remote_stats()["walks"] == walks
        assert b.flush(10)  # the hit counts reach the remote
        # clear --remote: every key of the prefix, on every node of a cluster
        assert b.keys.clear(b.client.client("slow")) == 3 + 3 + 3 + 1  # blobs, hit counters, index, namespaces
        assert a.prefix_walk(SMOL, tokens + [5] * 70).matched_tokens == 199  # a's local tier is its own
        c = tiered(tmp_path, "c", server.url, a.keys.prefix, cluster=topology == "cluster")
        assert c.prefix_walk(SMOL, tokens).matched_tokens == 0
        c.close()
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_records_of_remote_fragments_come_from_the_fetch_and_are_read_once(tmp_path, redis_server):
    """The RAM tier reads a chain's records before its fragments: a fragment only the remote
    holds has a record (the fetched one), and the read that follows costs no second fetch."""
    a, b, tokens, frags, match = _share_one_prompt(tmp_path, redis_server.url, new_prefix("life"))
    try:
        keys = [k for s in match.spans for k in s.keys]
        assert b.local.lifecycles(keys) == [None, None, None]
        lives = b.lifecycles(keys + [b"\x00" * 32])
        assert lives[-1] is None and all(life is not None for life in lives[:-1])
        assert [life.created_at for life in lives[:-1]] == [f.created_at for f in frags]
        assert all(life.expires_at > b.clock() for life in lives[:-1])
        assert b.remote_stats()["hits"] == 3
        got = [b.get(k) for k in keys]
        assert b.remote_stats()["hits"] == 3  # held since the records were read
        assert all(np.array_equal(g.keys, f.keys) and np.array_equal(g.values, f.values) for g, f in zip(got, frags))
        assert [b.lifecycle(k).created_at for k in keys] == [f.created_at for f in frags]
    finally:
        a.close()
        b.close()


def _split_chain(tmp_path, url, prefix, remote_has, local_has):
    """Node A stores ``prompt(0)``'s chain (3 fragments: [0,64), [64,128), [128,199)) on the
    remote, whose copies of the chunks not in ``remote_has`` are then deleted (as Redis's LRU
    eviction drops a blob and leaves its index entry); node B holds the chunks ``local_has`` in
    its local store only. Returns (a, b, tokens, fragments, blobs)."""
    tokens = prompt(0)
    frags = chain(tokens)
    a = tiered(tmp_path, "a", url, prefix)
    b = tiered(tmp_path, "b", url, prefix)
    assert a.put_many(frags) == 3 and a.flush(30)
    gone = [f.key() for i, f in enumerate(frags) if i not in remote_has]
    assert a.keys.delete(a.client.client("slow"), gone) == len(gone)
    assert b.local.put_many([frags[i] for i in local_has]) == len(local_has)
    return a, b, tokens, frags, [codec.encode(f) for f in frags]


def _lookups(store) -> list[str]:
    """Records the remote index lookups (one pipeline, one round trip, each) ``store`` makes."""
    calls, call = [], store.client.call

    def counted(which, op, what):
        if what == "index lookup":
            calls.append(which)
        return call(which, op, what)

    store.client.call = counted
    return calls


def _run_table(store_stats: dict) -> dict[str, str]:
    """``edgesync run``'s table over one request and ``store_stats``: the edgesync column by row."""
    from edgesync_bench import run_report

    result = {"tokens": [1], "hit": "miss", "ttft_ms": 1.0, "total_ms": 2.0, "prompt_tokens": 200,
              "tokens_reused": 0, "tokens_prefilled": 200, "bytes_read": 0, "lookup_ms": None}
    table = run_report.render_table(run_report.summarize([{"prompt_key": "k", "uncached": result,
                                                           "edgesync": result}]), store_stats, "t")
    return dict(zip(map(str, table.columns[0]._cells), map(str, table.columns[2]._cells)))


@pytest.mark.redis
@pytest.mark.parametrize("remote_has, local_has, lookups", [((1, 2), (0,), 2), ((0,), (1, 2), 4)],
                         ids=["local-head", "remote-head"])
def test_a_chain_split_across_the_tiers_is_walked_whole(tmp_path, redis_server, remote_has, local_has, lookups):
    """The local store holds one part of a prompt's chain, the remote the other (its copy of
    the rest evicted): the walk joins them, the remote part alone is fetched, and each key
    reads back the stored arrays. Round trips: the grid, the local chain's ends and the last
    position in one index pipeline and one existence pipeline; with the head remote, position
    64 (off the 128 grid, reached through the remote's span) costs one pair more."""
    a, b, tokens, frags, blobs = _split_chain(tmp_path, redis_server.url, new_prefix("split"), remote_has, local_has)
    try:
        assert b.local.prefix_walk(SMOL, tokens).matched_tokens == (64 if 0 in local_has else 0)
        calls = _lookups(b)
        match = b.prefix_walk(SMOL, tokens)
        assert match.matched_tokens == 199 and [s.keys for s in match.spans] == [[f.key()] for f in frags]
        assert len(calls) == lookups
        assert sum(s.compressed_nbytes for s in match.spans) == sum(len(x) for x in blobs)
        got = [b.get(f.key()) for f in frags]
        for g, f in zip(got, frags):
            assert g.key() == f.key() and np.array_equal(g.keys, f.keys) and np.array_equal(g.values, f.values)
        stats = b.remote_stats()
        assert stats["hits"] == len(remote_has) and stats["misses"] == 0
        assert stats["bytes_fetched"] == sum(len(blobs[i]) for i in remote_has)
        assert (stats["walks"], stats["walk_gains"], stats["walk_splits"]) == (1, 1, 1)
        assert _run_table(b.stats().to_dict())["remote tier: walks (reached further / chain split across both tiers)"] \
            == "1 (1 / 1)"
        b.record_hits([f.key() for f in frags])  # the fetched part is written locally: the next walk is local
        assert b.prefix_walk(SMOL, tokens).matched_tokens == 199 and len(calls) == lookups
        assert b.remote_stats()["walks"] == 1
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_a_split_chain_with_the_remote_down_is_the_local_part(tmp_path):
    """The same split (local [0,64), remote the rest) joined while the remote is up; once it is
    killed (a closed port) the walk is the local part alone, without an error, through three
    failed calls and then the open circuit (no call)."""
    from tools.redis_servers import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    a, b, tokens, frags, blobs = _split_chain(tmp_path, server.url, new_prefix("split-down"), (1, 2), (0,))
    try:
        assert b.prefix_walk(SMOL, tokens).matched_tokens == 199
        assert b.flush(10)  # the evicted blob's index entry is removed (behind) before the kill
        server.kill()
        for _ in range(FAILURES_TO_OPEN + 2):
            match = b.prefix_walk(SMOL, tokens)
            assert match.matched_tokens == 64 and [s.keys for s in match.spans] == [[frags[0].key()]]
        stats = b.remote_stats()
        assert stats["connection"] == FAILURES_TO_OPEN and stats["circuit_open"] and stats["skipped"] == 2
        assert (stats["walks"], stats["walk_gains"], stats["walk_splits"]) == (1, 1, 1)
        assert b.get(frags[0].key()) is not None and b.get(frags[1].key()) is None  # skipped, not an error
    finally:
        a.close()
        b.close()
        server.stop()


@pytest.mark.redis
def test_remote_expiry_follows_the_lifetime_tier_and_hits_are_summed(tmp_path, redis_server):
    prefix = new_prefix("ttl")
    a, b, tokens, frags, match = _share_one_prompt(tmp_path, redis_server.url, prefix)
    r = _client(redis_server.url)
    blob_key = f"{prefix}:{{{frags[0].key().hex()}}}:b"
    try:
        policy = TTLPolicy()
        assert 0 < r.pttl(blob_key) <= policy.ttl_seconds * 1000  # short lifetime: what is left of 30 minutes
        keys = [frags[0].key()]
        for node in (a, b, a, b):  # four hits from two nodes
            node.record_hits(keys)
        assert a.flush(10) and b.flush(10)
        assert int(r.get(f"{prefix}:{{{frags[0].key().hex()}}}:n")) == 4
        assert r.pttl(blob_key) <= policy.ttl_seconds * 1000  # not promoted yet
        b.record_hits(keys)  # the fifth, summed over the nodes: promoted on the remote
        assert b.flush(10)
        assert r.pttl(blob_key) > policy.ttl_seconds * 1000
        c = tiered(tmp_path, "c", redis_server.url, prefix)
        got = c.get(frags[0].key())
        assert got.hit_count == 5
        c.record_hits(keys)
        assert c.local.lifecycle(frags[0].key()).lifetime == LIFETIME_LONG  # arrives promoted
        c.close()
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_namespaces_and_prefixes_keep_fragments_apart(tmp_path, redis_server):
    prefix = new_prefix("apart")
    a, b, tokens, frags, match = _share_one_prompt(tmp_path, redis_server.url, prefix)
    other = tiered(tmp_path, "other-tenant", redis_server.url, new_prefix("tenant2"))
    try:
        assert match.matched_tokens == 199
        assert b.prefix_walk(OTHER, tokens).matched_tokens == 0  # another model's namespace
        assert other.prefix_walk(SMOL, tokens).matched_tokens == 0  # another deployment's prefix
        assert {ns.digest() for ns in b.namespaces()} == {SMOL.digest()}
    finally:
        for s in (a, b, other):
            s.close()


@pytest.mark.redis
def test_forget_and_clear_remove_from_both_tiers(tmp_path, redis_server):
    prefix = new_prefix("forget")
    a, b, tokens, frags, match = _share_one_prompt(tmp_path, redis_server.url, prefix)
    keeper = new_prefix("keep")
    k = tiered(tmp_path, "k", redis_server.url, keeper)
    r = _client(redis_server.url)
    try:
        assert k.put_many(chain(prompt(1))) == 3 and k.flush(10)
        assert a.forget_tokens(SMOL, tokens) == 3
        assert a.local.prefix_walk(SMOL, tokens).matched_tokens == 0
        assert b.prefix_walk(SMOL, tokens).matched_tokens == 0  # gone from the remote too
        assert [key for key in r.scan_iter(match=f"{prefix}:{{*")] == []
        kept = len(list(r.scan_iter(match=f"{keeper}:*")))
        assert kept == 3 + 3 + 1  # the other prefix's 3 blobs, 3 index hashes and namespaces hash
    finally:
        a.close()
        b.close()
    removed = k.keys.clear(k.client.client("slow"))
    assert removed == kept and list(r.scan_iter(match=f"{keeper}:*")) == []
    k.close()


@pytest.mark.redis
def test_a_prefix_owns_exactly_its_own_keys(tmp_path, redis_server):
    """No prefix holds ':' (so ``shop`` cannot own ``shop:17``'s keys), and clearing a prefix
    removes exactly its layout's names: not a neighbour's (``shop-17``), not names of another
    form under it (what a ``shop:17`` prefix wrote before ':' was refused, or another program's)."""
    from edgesync_store.remote.commands import clear_remote
    from edgesync_store.remote.tier import KeyLayout
    from edgesync_store.remote.tiered import TieredStore

    for bad in ("shop:17", "shop:", ":shop", "shop\n"):
        with pytest.raises(ValueError, match="remote_prefix: .*no ':'"):
            EdgeSyncConfig.load({"remote_prefix": bad}, environ={})
        with pytest.raises(ValueError, match="no ':'"):
            KeyLayout(bad)
    with pytest.raises(ValueError, match="EDGESYNC_REMOTE_PREFIX"):
        EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_PREFIX": "shop:17"})
    with pytest.raises(ValueError, match="remote prefix"):
        TieredStore.connect(None, redis_server.url, prefix="shop:17")
    shop = new_prefix("shop")
    neighbour = f"{shop}-17"
    r = _client(redis_server.url)
    for name, p in (("shop", shop), ("neighbour", neighbour)):
        store = tiered(tmp_path, name, redis_server.url, p)
        assert store.put_many(chain(prompt(6))) == 3 and store.flush(10)
        store.close()
    key = chain(prompt(6))[0].key().hex()
    foreign = [f"{shop}:17:{{{key}}}:b", f"{shop}:17:ns", f"{shop}:other", f"{shop}:{{{key}}}:x", f"{shop}:nsx"]
    for name in foreign:
        r.set(name, "not ours")
    mine = sorted(n.decode() for n in r.scan_iter(match=f"{shop}:*") if n.decode() not in foreign)
    assert len(mine) == 3 + 3 + 1 and all(KeyLayout(shop).own(n) for n in mine)
    assert not any(KeyLayout(shop).own(n) for n in foreign)
    assert clear_remote(redis_server.url, shop) == 7
    assert sorted(n.decode() for n in r.scan_iter(match=f"{shop}:*")) == sorted(foreign)
    assert len(list(r.scan_iter(match=f"{neighbour}:*"))) == 7
    r.delete(*foreign)


def _index_fields(r, prefix: str) -> dict[bytes, str]:
    return {field: ikey for ikey in r.scan_iter(match=f"{prefix}:i:*") for field in r.hkeys(ikey)}


@pytest.mark.redis
def test_an_index_entry_only_for_a_stored_blob(tmp_path):
    """Redis at maxmemory with noeviction refuses some blobs: none of them is left in the index
    (the blob is written first, its index entry only once it is stored)."""
    from tools.redis_servers import RedisServer

    server = RedisServer(tmp_path / "redis", args=("--maxmemory", "6mb", "--maxmemory-policy", "noeviction")).start()
    prefix = new_prefix("oom-index")
    store = tiered(tmp_path, "node", server.url, prefix)
    try:
        frags = [f for seed in range(3) for f in chain(prompt(10 + seed))]
        assert store.put_many(frags) == 9 and store.flush(30)
        stats = store.remote_stats()
        assert stats["oom"] >= 1 and stats["puts"] >= 1 and stats["oom"] + stats["puts"] == 9
        r = _client(server.url)
        fields = _index_fields(r, prefix)
        assert len(fields) == stats["puts"]
        assert all(r.exists(store.keys.blob_key(bytes(f))) for f in fields)
    finally:
        store.close()
        server.stop()


@pytest.mark.redis
def test_a_repeated_failure_warns_once_per_kind_and_counts(tmp_path, caplog):
    """A full server refuses several writes: one WARNING, the repeats at DEBUG, each line with
    the count so far; then the server dies: the first connection failure warns, the next is
    DEBUG, the third opens the circuit (one WARNING)."""
    from tools.redis_servers import RedisServer

    server = RedisServer(tmp_path / "redis", args=("--maxmemory", "6mb", "--maxmemory-policy", "noeviction")).start()
    store = tiered(tmp_path, "node", server.url, new_prefix("oom-log"), retry_s=60)
    try:
        with caplog.at_level(logging.DEBUG, logger="edgesync_store"):
            assert store.put_many([f for seed in range(3) for f in chain(prompt(10 + seed))]) == 9 and store.flush(30)
            oom = store.remote_stats()["oom"]
            server.kill()
            assert store.put_many(chain(prompt(13))) == 3 and store.flush(30)

        def lines(text: str) -> list[logging.LogRecord]:
            return [rec for rec in caplog.records if text in rec.getMessage()]

        full = lines("is full")
        assert oom >= 2 and [rec.levelno for rec in full] == [logging.WARNING] + [logging.DEBUG] * (oom - 1)
        assert "(1 refused so far" in full[0].getMessage() and f"({oom} refused so far" in full[-1].getMessage()
        assert [rec.levelno for rec in lines("failed (connection")] == [logging.WARNING, logging.DEBUG]
        assert [rec.levelno for rec in lines("failed calls in a row")] == [logging.WARNING]
        assert store.remote_stats()["connection"] == 3 and store.remote_stats()["breaker_opens"] == 1
    finally:
        store.close()
        server.stop()


@pytest.mark.redis
def test_a_blob_without_its_index_entry_is_indexed_again_by_the_next_writer(tmp_path, redis_server):
    prefix = new_prefix("reindex")
    a, b, tokens, frags, match = _share_one_prompt(tmp_path, redis_server.url, prefix)
    r = _client(redis_server.url)
    try:
        lost = frags[1].key()
        fields = _index_fields(r, prefix)
        assert r.hdel(fields[lost], lost) == 1  # as an index write refused after its blob was stored
        c = tiered(tmp_path, "c", redis_server.url, prefix)
        assert c.prefix_walk(SMOL, tokens).matched_tokens == 64  # the chain is broken there
        c.close()
        d = tiered(tmp_path, "d", redis_server.url, prefix)  # computed the same prompt: writes it
        assert d.put_many(chain(tokens)) == 3 and d.flush(10)
        assert d.remote_stats()["puts"] == 0  # every blob was there: none sent again
        assert lost in _index_fields(r, prefix)
        d.close()
        e = tiered(tmp_path, "e", redis_server.url, prefix)
        assert e.prefix_walk(SMOL, tokens).matched_tokens == 199
        e.close()
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_a_flipped_byte_in_a_remote_blob_is_refused_and_deleted(tmp_path, redis_server):
    prefix = new_prefix("flip")
    a, b, tokens, frags, match = _share_one_prompt(tmp_path, redis_server.url, prefix)
    r = _client(redis_server.url)
    blob_key = f"{prefix}:{{{frags[1].key().hex()}}}:b"
    try:
        at = r.strlen(blob_key) // 2  # inside the compressed tensors
        r.setrange(blob_key, at, bytes([r.getrange(blob_key, at, at)[0] ^ 0x01]))
        assert b.get(frags[0].key()) is not None
        assert b.get(frags[1].key()) is None  # the payload CRC refuses it
        assert b.remote_stats()["corrupt"] == 1 and b.dropped_corrupt == 1 and r.exists(blob_key) == 0
        assert b.get(frags[1].key()) is None and b.remote_stats()["hits"] == 1  # never asked for again
        assert b.prefix_walk(SMOL, tokens).matched_tokens == 64  # the walk stops where the chain is broken
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_a_foreign_blob_under_a_key_is_refused(tmp_path, redis_server):
    """A valid blob of another fragment stored under this key (a writer with another layout,
    or a tampered server): the key check refuses it."""
    prefix = new_prefix("foreign")
    a, b, tokens, frags, match = _share_one_prompt(tmp_path, redis_server.url, prefix)
    r = _client(redis_server.url)
    try:
        r.set(f"{prefix}:{{{frags[2].key().hex()}}}:b", codec.encode(frags[0]))
        assert b.get(frags[2].key()) is None and b.remote_stats()["corrupt"] == 1
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_unusable_remote_values_are_skipped_counted_and_deleted(tmp_path, redis_server, caplog):
    """Values of the wrong form or type under the tier's names (a hand-typed ``SET``, another
    program): the fragment is still served, the value is logged, counted and deleted, and no
    call fails or opens the circuit."""
    prefix = new_prefix("garbage")
    a, b, tokens, frags, match = _share_one_prompt(tmp_path, redis_server.url, prefix)
    r = _client(redis_server.url)
    counter = [b.keys.hits_key(f.key()) for f in frags]
    try:
        r.set(counter[0], "garbage")
        r.rpush(counter[1], "not", "a", "string")
        with caplog.at_level(logging.WARNING, logger="edgesync_store"):
            got = [b.get(f.key()) for f in frags]
            assert b.flush(10)
        assert [g.key() for g in got] == [f.key() for f in frags] and [g.hit_count for g in got] == [0, 0, 0]
        assert np.array_equal(got[0].keys, frags[0].keys) and np.array_equal(got[1].values, frags[1].values)
        assert b.remote_stats()["bad_values"] == 2 and r.exists(counter[0], counter[1]) == 0
        assert counter[0] in caplog.text and "b'garbage'" in caplog.text
        r.set(counter[2], "12x")  # INCR refuses it: the batch's other hits still count
        b.record_hits([f.key() for f in frags])
        assert b.flush(10)
        assert [r.get(c) for c in counter] == [b"1", b"1", None]
        assert b.remote_stats()["hits_recorded"] == 2 and b.remote_stats()["bad_values"] == 3
        # an index entry and the namespaces hash that are not hashes: a third node walks past them
        first_index = b.keys.index_key(SMOL.digest(), frags[0].prefix_hash)
        r.delete(first_index, b.keys.namespaces_key)
        r.set(first_index, "junk")
        r.set(b.keys.namespaces_key, "junk")
        c = tiered(tmp_path, "c", redis_server.url, prefix)
        assert c.prefix_walk(SMOL, tokens).matched_tokens == 0 and c.namespaces() == []
        assert c.flush(10) and r.exists(first_index, b.keys.namespaces_key) == 0
        assert c.remote_stats()["bad_values"] == 2
        for node in (b, c):
            assert node.remote_stats()["errors"] == 0 and not node.remote_stats()["circuit_open"]
        c.close()
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_the_fetch_budget_bounds_a_whole_fetch_not_one_read(tmp_path, redis_server):
    """A link that trickles (32 KB per 12 ms: every socket read well inside the per-read timeout,
    a 280 KB blob at least 96 ms): with a 30 ms budget the fetch is abandoned after its first
    chunk, counted as a timeout, the request path's circuit opens at once, and nothing is kept;
    with a large budget the same fetch completes (the per-read timeout alone never stops it)."""
    from tests.delay_proxy import DelayProxy

    prefix = new_prefix("trickle")
    a = tiered(tmp_path, "a", redis_server.url, prefix)
    frags = chain(prompt(14))
    assert a.put_many(frags) == 3 and a.flush(10)
    a.close()
    blob = codec.encode(frags[0])
    proxy = DelayProxy(redis_server.port, 0.012, piece=32 * 1024)
    quick = tiered(tmp_path, "quick", proxy.url, prefix, timeout_ms=500, fetch_budget_ms=30)
    patient = tiered(tmp_path, "patient", proxy.url, prefix, timeout_ms=500, fetch_budget_ms=60_000)
    try:
        assert quick.get(frags[0].key()) is None
        stats = quick.remote_stats()
        assert stats["timeout"] == 1 and stats["hits"] == stats["misses"] == stats["corrupt"] == 0
        assert stats["breaker_opens"] == 1 and stats["circuit_open"]  # too slow for the request path: at once
        assert len(blob) > 2 * 128 * 1024 and proxy.bytes_down < len(blob)  # stopped before the end
        quick.flush(10)
        assert quick.local.get(frags[0].key()) is None  # nothing partial kept
        before = proxy.bytes_down
        got = patient.get(frags[0].key())
        assert got is not None and got.key() == frags[0].key() and np.array_equal(got.keys, frags[0].keys)
        assert patient.remote_stats()["timeout"] == 0 and proxy.bytes_down - before > len(blob)
    finally:
        quick.close()
        patient.close()
        proxy.stop()


def test_a_dead_remote_opens_the_circuit_and_the_local_tier_serves(tmp_path, caplog):
    url = f"redis://:s3cret-pass@127.0.0.1:{free_port()}/0"  # nothing listens there
    store = tiered(tmp_path, "alone", url, new_prefix("dead"), timeout_ms=20, retry_s=60)
    tokens = prompt(2)
    try:
        with caplog.at_level(logging.DEBUG, logger="edgesync_store"):
            assert store.put_many(chain(tokens)) == 3
            assert store.flush(10)
            for _ in range(FAILURES_TO_OPEN + 2):
                assert store.prefix_walk(SMOL, tokens + [7] * 80).matched_tokens == 199  # local, longer prompt
        stats = store.remote_stats()
        # the writer's and the request path's circuits each opened after three failures
        assert stats["connection"] == 2 * FAILURES_TO_OPEN and stats["breaker_opens"] == 2 and stats["circuit_open"]
        assert stats["write_skips"] == 3 and stats["skipped"] == 2
        assert "s3cret-pass" not in caplog.text and "redis://:***@127.0.0.1" in caplog.text
    finally:
        store.close()


def test_the_url_password_is_never_shown():
    url = "redis://edge:p%40ss-w0rd@10.0.0.5:6380/2?password=p%40ss-w0rd"
    cfg = EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_URL": url})
    assert cfg.remote_url.secret == url and cfg.remote_url.password == "p@ss-w0rd"
    assert (cfg.remote_url.host, cfg.remote_url.port, cfg.remote_url.db) == ("10.0.0.5", 6380, 2)
    for text in (repr(cfg), str(cfg.to_dict()), str(cfg.remote_url)):
        assert "w0rd" not in text and "edge:***@10.0.0.5:6380" in text
    with pytest.raises(ValueError) as err:
        EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_URL": "http://u:hunter2@host"})
    assert "hunter2" not in str(err.value) and "EDGESYNC_REMOTE_URL" in str(err.value)
    with pytest.raises(ValueError, match="remote_prefix"):
        EdgeSyncConfig.load({"remote_prefix": "a{b}"}, environ={})


PASSWORD_TAIL = "SECRETTAIL"


@pytest.mark.redis
@pytest.mark.parametrize("sep", ["/", "#", "?"])
def test_a_password_with_url_delimiters_never_shows(tmp_path, redis_server, caplog, sep):
    """A password holding ``/``, ``#`` or ``?`` typed as it is: refused at load with a message
    naming the variable and the fix, the password in no form in it (nor on the command's
    stderr); percent-encoded, it connects, and a failing call's log line hides it too."""
    import os
    import subprocess
    import sys
    from urllib.parse import quote

    password = f"ab{sep}{PASSWORD_TAIL}@x"
    typed = f"redis://:{password}@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(ValueError) as err:
        EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_URL": typed})
    message = str(err.value)
    assert "EDGESYNC_REMOTE_URL" in message and "percent-encode" in message and PASSWORD_TAIL not in message
    assert f"redis://:***@127.0.0.1:{redis_server.port}/0" in message
    with pytest.raises(ValueError) as err:
        EdgeSyncConfig.load({"remote_url": typed}, environ={})
    assert str(err.value).startswith("remote_url: ") and PASSWORD_TAIL not in str(err.value)
    in_query = f"redis://127.0.0.1:{redis_server.port}/0?password=ab&{PASSWORD_TAIL}"  # '&' typed as it is
    with pytest.raises(ValueError) as err:
        EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_URL": in_query})
    assert "EDGESYNC_REMOTE_URL" in str(err.value) and PASSWORD_TAIL not in str(err.value)
    env = {**os.environ, "EDGESYNC_REMOTE_URL": typed}
    cmd = [sys.executable, "-m", "edgesync_engines.app.cli", "clear", str(tmp_path / "s"), "--yes", "--remote"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "EDGESYNC_REMOTE_URL" in done.stderr
    assert PASSWORD_TAIL not in done.stdout + done.stderr
    encoded = f"redis://:{quote(password, safe='')}@127.0.0.1:{redis_server.port}/0"
    cfg = EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_URL": encoded})
    assert cfg.remote_url.password == password and PASSWORD_TAIL not in repr(cfg) + str(cfg.to_dict())
    redis_server.cli("CONFIG", "SET", "requirepass", password)
    try:
        with caplog.at_level(logging.DEBUG, logger="edgesync_store"):
            store = tiered(tmp_path, "node", cfg.remote_url, new_prefix("pw"))
            assert store.put_many(chain(prompt(5))) == 3 and store.flush(10)
            assert store.remote_stats()["puts"] == 3 and store.remote_stats()["errors"] == 0
            store.close()
            wrong = tiered(tmp_path, "wrong", encoded.replace("ab", "ba", 1), new_prefix("pw"))
            assert wrong.put_many(chain(prompt(5))) == 3 and wrong.flush(10)
            assert wrong.remote_stats()["other"] + wrong.remote_stats()["connection"] == 3
            wrong.close()
        assert PASSWORD_TAIL not in caplog.text and "redis://:***@127.0.0.1" in caplog.text
    finally:
        redis_server.cli("-a", password, "--no-auth-warning", "CONFIG", "SET", "requirepass", "")


@pytest.mark.redis
@pytest.mark.parametrize("query", ["?db=x", "?socket_timeout=abc", "?foo=1", "?ssl_ca_certs=/etc/ca.pem",
                                   "?retry_on_timeout=yes"])
def test_bad_url_arguments_are_refused_at_load(tmp_path, redis_server, query):
    """The URL's query arguments are checked when the settings load (redis-py's own URL parser,
    the options the tier passes on), naming EDGESYNC_REMOTE_URL; ``edgesync clear --remote``
    says so and exits 2."""
    import os
    import subprocess
    import sys

    url = f"redis://127.0.0.1:{redis_server.port}/0{query}"
    with pytest.raises(ValueError, match="EDGESYNC_REMOTE_URL") as err:
        EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_URL": url})
    assert query.split("=")[0].lstrip("?") in str(err.value)
    with pytest.raises(ValueError, match="remote"):
        tiered(tmp_path, "s", url, new_prefix("args"))
    env = {**os.environ, "EDGESYNC_REMOTE_URL": url}
    cmd = [sys.executable, "-m", "edgesync_engines.app.cli", "clear", str(tmp_path / "s"), "--yes", "--remote"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "EDGESYNC_REMOTE_URL" in done.stderr and "Traceback" not in done.stderr


def test_database_numbers_are_checked_at_load_and_on_the_server():
    for url, problem in (("redis://h/99999999999", "out of range"), ("redis://h/0?db=-1", "database number")):
        with pytest.raises(ValueError, match=problem):
            EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_URL": url})
    with pytest.raises(ValueError, match="database 0 only"):
        EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_URL": "redis://h/2", "EDGESYNC_REMOTE_CLUSTER": "1"})
    assert EdgeSyncConfig.load(environ={"EDGESYNC_REMOTE_URL": "redis://h/3?db=2"}).remote_url.db == 2  # as redis-py


def test_a_value_redis_py_refuses_never_reaches_a_client():
    """The URL is read by redis-py's own parser when it is made, so a query value redis-py
    refuses cannot slip past into a client (no client is built without a ``RemoteURL``)."""
    from edgesync_store.remote.client import RemoteClient

    with pytest.raises(ValueError, match="socket_timeout") as err:
        RemoteClient("redis://:hunter2@127.0.0.1:1/0?socket_timeout=abc")
    assert "hunter2" not in str(err.value)


@pytest.mark.redis
@pytest.mark.parametrize("query", ["/99", "/0?foo=1"])
def test_url_errors_met_at_run_time_leave_the_node_local_only(tmp_path, redis_server, caplog, query):
    """What only the server can refuse (database 99 of a 16-database server), or an option that
    slipped past the checks (a client built without ``connect``): every operation of the seam
    goes on local-only, with a warning that names EDGESYNC_REMOTE_URL."""
    from edgesync_store.core.store import FragmentStore
    from edgesync_store.remote.client import RemoteClient
    from edgesync_store.remote.tiered import TieredStore

    url = f"redis://127.0.0.1:{redis_server.port}{query}"
    store = TieredStore(FragmentStore(tmp_path / "node"), RemoteClient(url, timeout_ms=2000), prefix=new_prefix("rt"))
    tokens, frags = prompt(7), chain(prompt(7))
    try:
        with caplog.at_level(logging.WARNING, logger="edgesync_store"):
            assert store.put_many(frags) == 3 and store.flush(10)
            assert store.prefix_walk(SMOL, tokens + [9] * 70).matched_tokens == 199  # the local chain
            assert store.get(chain(prompt(8))[0].key()) is None
            store.record_hits([frags[0].key()])
            assert {ns.digest() for ns in store.namespaces()} == {SMOL.digest()}
            assert store.keys_along(SMOL, tokens) and store.forget_tokens(SMOL, tokens) == 3
            assert store.flush(10)
        stats = store.remote_stats()
        assert stats["puts"] == 0 and stats["errors"] >= 3 and stats["errors"] == stats["other"]
        assert "EDGESYNC_REMOTE_URL" in caplog.text
    finally:
        store.close()


def test_the_write_queue_drops_its_oldest_when_full():
    release, ran, drops = threading.Event(), [], []
    queue = WriteBehind(2, on_drop=lambda: drops.append(1))
    queue.submit(release.wait)  # the writer is busy with this one
    while len(queue):
        pass
    for i in range(5):
        queue.submit(lambda i=i: ran.append(i))
    release.set()
    assert queue.drain(5) and ran == [3, 4] and len(drops) == 3
    queue.close(1)


@pytest.mark.redis
@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_an_acl_user_with_only_the_listed_commands_suffices(tmp_path, request, topology):
    """The README's ACL user: these commands on these keys, nothing else."""
    cluster = topology == "cluster"
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    prefix = new_prefix("acl")
    for node in server.nodes if cluster else [server]:
        node.cli("ACL", "SETUSER", "edge", "on", ">edge-secret", f"~{prefix}:*", "resetchannels", "-@all",
                 *[f"+{c}" for c in COMMANDS + (CLUSTER_COMMANDS if cluster else ())])
    port = server.nodes[0].port if cluster else server.port
    url = f"redis://edge:edge-secret@127.0.0.1:{port}/0"
    tokens = prompt(3)
    a, b = tiered(tmp_path, "a", url, prefix, cluster=cluster), tiered(tmp_path, "b", url, prefix, cluster=cluster)
    try:
        assert a.put_many(chain(tokens)) == 3 and a.flush(10)
        match = b.prefix_walk(SMOL, tokens)
        assert match.matched_tokens == 199 and all(b.get(k) for s in match.spans for k in s.keys)
        b.record_hits(match.spans[0].keys)
        assert b.flush(10) and b.namespaces()
        assert b.forget_tokens(SMOL, tokens) == 3
        assert b.remote_stats()["errors"] == 0 and a.remote_stats()["errors"] == 0
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_the_clear_command_with_remote(tmp_path, redis_server):
    """``edgesync clear --remote`` (a subprocess): the local store and every key under the prefix,
    another prefix untouched; refused without a configured remote; the password never printed."""
    import json
    import os
    import subprocess
    import sys

    prefix, other = new_prefix("cli"), new_prefix("cli-other")
    redis_server.cli("CONFIG", "SET", "requirepass", "cli-pa55")
    url = f"redis://:cli-pa55@127.0.0.1:{redis_server.port}/0"
    try:
        for name, p in (("node", prefix), ("other", other)):
            store = tiered(tmp_path, name, url, p)
            assert store.put_many(chain(prompt(4))) == 3 and store.flush(10)
            store.close()
        env = {**os.environ, "EDGESYNC_REMOTE_URL": url, "EDGESYNC_REMOTE_PREFIX": prefix}
        cmd = [sys.executable, "-m", "edgesync_engines.app.cli", "clear", str(tmp_path / "node"), "--yes", "--remote"]
        done = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["fragments_removed"] == 3 and doc["remote_keys_removed"] == 3 + 3 + 1 and doc["remote_error"] is None
        r = redis.Redis.from_url(url)
        assert list(r.scan_iter(match=f"{prefix}:*")) == [] and len(list(r.scan_iter(match=f"{other}:*"))) == 7
        text = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert text.returncode == 0 and "remote tier redis://:***@127.0.0.1" in text.stdout
        assert "cli-pa55" not in text.stdout + text.stderr + done.stdout + done.stderr
        env.pop("EDGESYNC_REMOTE_URL")
        refused = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert refused.returncode == 2 and "no remote tier is configured" in refused.stderr
    finally:
        redis_server.cli("-a", "cli-pa55", "--no-auth-warning", "CONFIG", "SET", "requirepass", "")


def test_the_clear_command_with_the_remote_down_reports_both_outcomes(tmp_path):
    """The local store is cleared, the remote tier cannot be: both are printed (one JSON object with
    --json), the exit status is 3 (the remote's failure), the password never shown."""
    import json
    import os
    import subprocess
    import sys

    from edgesync_store.core.store import FragmentStore

    url = f"redis://:down-pa55@127.0.0.1:{free_port()}/0"  # nothing listens there
    env = {**os.environ, "EDGESYNC_REMOTE_URL": url, "EDGESYNC_REMOTE_PREFIX": new_prefix("down")}
    cmd = [sys.executable, "-m", "edgesync_engines.app.cli", "clear", str(tmp_path / "node"), "--yes", "--remote"]
    for as_json in (True, False):
        with FragmentStore(tmp_path / "node") as store:
            assert store.put_many(chain(prompt(9))) == 3
        done = subprocess.run(cmd + ["--json"] * as_json, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 3, done.stderr
        assert "error: the local store was cleared, the remote tier was not: remote tier redis://:***@127.0.0.1" \
            in done.stderr
        assert "down-pa55" not in done.stdout + done.stderr and "Traceback" not in done.stderr
        if as_json:
            doc = json.loads(done.stdout)
            assert doc["fragments_removed"] == 3 and doc["remote_keys_removed"] is None
            assert "connection" in doc["remote_error"] and "redis://:***@127.0.0.1" in doc["remote_error"]
        else:
            assert "3 fragments removed" in done.stdout and "; remote tier redis://:***@" in done.stdout
            assert "not cleared: " in done.stdout
        with FragmentStore(tmp_path / "node") as store:
            assert store.stats().fragments == 0
