"""Acceptance of the shared remote tier on the real model (SmolLM2-135M through llama.cpp) and
real redis-server processes.

1. Two nodes: two processes (tests/proc_remote_node.py) with separate local stores and one
   Redis, standalone and a 3-master cluster: node B's first ask of the prompt node A answered is
   an exact hit with at most one token prefilled, every fragment fetched from the remote, and the
   same tokens as an uncached run.
2. Faults, each answer checked against the uncached one, no request failing, the local store
   intact: the Redis server SIGKILLed mid-run and restarted; a 200 ms delay (a loopback proxy,
   tests/delay_proxy.py: the one fault a real server cannot be made to show); a flipped byte in
   a remote blob; Redis at maxmemory with ``noeviction``.

The in-process nodes share the session's engine (the ``adapter`` fixture), each with its own
local store; the semantic lookup and the store jobs are off (they do not touch the remote).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from edgesync_store.core.store import FragmentStore
from edgesync_store.remote.tiered import TieredStore
from tests.delay_proxy import DelayProxy
from tests.remote_support import new_prefix
from tools.redis_servers import RedisServer

pytestmark = [pytest.mark.model, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
QUESTION = "How do I make a good first impression?"
CFG = EdgeSyncConfig.load({"semantic": False, "jobs": False, "max_tokens": MAX_TOKENS}, environ={})
_UNCACHED: dict[str, list[int]] = {}


def _messages(system_prompts, i: int) -> list[dict]:
    return [{"role": "system", "content": system_prompts[i]}, {"role": "user", "content": QUESTION}]


def _node(adapter, tmp_path: Path, name: str, url: str, prefix: str, **options) -> EdgeSync:
    """An in-process node: the session's engine, its own local store, the remote at ``url``."""
    options.setdefault("timeout_ms", 1000.0)
    store = TieredStore.connect(FragmentStore(tmp_path / name), url, prefix=prefix, **options)
    return EdgeSync(adapter, store=store, config=CFG)


def _answer(es: EdgeSync, messages: list[dict]):
    """EdgeSync's answer, asserted equal to the uncached run's (computed once per prompt)."""
    result = es.generate(messages)
    key = json.dumps(messages)
    if key not in _UNCACHED:
        _UNCACHED[key] = EdgeSync(es.adapter, store=False, config=CFG).generate(messages).tokens
    assert result.tokens == _UNCACHED[key]
    return result


def _intact(store: TieredStore) -> int:
    """Every local fragment reads back verified; returns how many there are."""
    rows = list(store.local.iterate())
    assert all(head is not None and store.local.get(key) is not None for key, head, _life, _n in rows)
    assert store.local.dropped_corrupt == 0
    return len(rows)


def _run_node(tmp_path: Path, name: str, url: str, prefix: str, requests: list, cluster: bool) -> list[dict]:
    (tmp_path / f"{name}.json").write_text(json.dumps(requests))
    # the nodes run one after the other: each child's engine takes every core (EDGESYNC_THREADS
    # of the environment, when set, still decides)
    env = {**os.environ, "EDGESYNC_REMOTE_URL": url, "EDGESYNC_REMOTE_PREFIX": prefix,
           "EDGESYNC_REMOTE_CLUSTER": "1" if cluster else "0", "EDGESYNC_REMOTE_TIMEOUT_MS": "1000",
           "EDGESYNC_SEMANTIC": "0", "EDGESYNC_JOBS": "0"}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "proc_remote_node.py"), str(tmp_path / name),
                          str(tmp_path / f"{name}.json"), str(MAX_TOKENS)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_node_b_is_served_what_node_a_prefilled(tmp_path, request, system_prompts, topology):
    server = request.getfixturevalue("redis_server" if topology == "standalone" else "redis_cluster")
    prefix, messages = new_prefix(f"nodes-{topology}"), _messages(system_prompts, 0)
    (a,) = _run_node(tmp_path, "a", server.url, prefix, [messages], topology == "cluster")
    (b,) = _run_node(tmp_path, "b", server.url, prefix, [messages], topology == "cluster")
    assert a["hit"] == "miss" and a["tokens"] == a["uncached_tokens"] and a["fragments_written"] == 3
    assert b["hit"] == "exact" and b["tokens_prefilled"] <= 1 and b["tokens"] == b["uncached_tokens"]
    assert b["tokens_reused"] == b["prompt_tokens"] - b["tokens_prefilled"]
    assert b["remote"]["hits"] == 3 and b["remote"]["bytes_fetched"] == b["bytes_read"] > 1_000_000
    assert b["remote"]["errors"] == 0 and b["fragments_written"] == 0
    print(f"\n[{topology}] node B: TTFT {b['ttft_ms']:.1f} ms against {b['uncached_ttft_ms']:.1f} ms uncached, "
          f"{b['remote']['bytes_fetched']:,} bytes fetched for {b['tokens_reused']} of {b['prompt_tokens']} tokens")


def test_the_remote_killed_mid_run_and_restarted(adapter, tmp_path, system_prompts):
    server = RedisServer(tmp_path / "redis").start()
    prefix = new_prefix("kill")
    es = _node(adapter, tmp_path, "node", server.url, prefix, retry_s=0.2)
    try:
        first = _answer(es, _messages(system_prompts, 0))
        server.kill(signal.SIGKILL)  # while the first answer's writes may still be queued
        assert _answer(es, _messages(system_prompts, 0)).hit == "exact"  # the local tier serves on
        assert es.store.flush(30)  # the queued writes fail (counted), none is left waiting
        assert first.hit == "miss" and es.store.remote_stats()["connection"] >= 1
        server.start()  # same port, empty (no persistence)
        time.sleep(max(b.wait_s for b in es.store.client.breakers.values()) + 0.05)  # open circuits' wait
        assert _answer(es, _messages(system_prompts, 2)).hit == "miss"
        assert es.store.flush(30)
        stats = es.store.remote_stats()
        assert stats["puts"] >= 3 and not stats["circuit_open"]
        other = _node(adapter, tmp_path, "other", server.url, prefix)
        again = _answer(other, _messages(system_prompts, 2))  # written after the restart, served remotely
        assert again.hit == "exact" and other.store.remote_stats()["hits"] == 3
        other.close()
        assert _intact(es.store) == 6  # two prompts of three chunks
    finally:
        es.close()
        server.stop()


def test_a_remote_200_ms_late_is_left_behind(adapter, tmp_path, system_prompts, redis_server):
    prefix, messages = new_prefix("slow"), _messages(system_prompts, 0)
    a = _node(adapter, tmp_path, "a", redis_server.url, prefix)
    _answer(a, messages)
    assert a.store.flush(30)
    a.close()
    proxy = DelayProxy(redis_server.port, 0.2)
    b = _node(adapter, tmp_path, "b", proxy.url, prefix, timeout_ms=20, retry_s=60)
    try:
        assert _answer(b, messages).hit == "miss"  # the remote holds it, too late: prefilled
        assert _answer(b, messages).hit == "exact"  # local from now on
        stats = b.store.remote_stats()
        assert stats["timeout"] >= 1 and stats["hits"] == 0 and stats["walks"] == 0
        assert _intact(b.store) == 3
    finally:
        proxy.stop()  # the queued writes then fail at once instead of crawling through it
        b.close()


def test_a_remote_that_trickles_is_left_behind(adapter, tmp_path, system_prompts, redis_server):
    """Replies trickling at 32 KB per 12 ms: each socket read is quick, a 2.3 MB fragment would
    take some 860 ms. The fetch budget (50 ms here) abandons the first fragment's fetch and opens
    the request path's circuit (the request's second walk stays local), the request prefills, the
    answer is the uncached one."""
    prefix, messages = new_prefix("trickle"), _messages(system_prompts, 0)
    a = _node(adapter, tmp_path, "a", redis_server.url, prefix)
    _answer(a, messages)
    assert a.store.flush(30)
    smallest = min(n for _k, _h, _l, n in a.store.local.iterate())
    a.close()
    proxy = DelayProxy(redis_server.port, 0.012, piece=32 * 1024)
    b = _node(adapter, tmp_path, "b", proxy.url, prefix, timeout_ms=500, fetch_budget_ms=50, retry_s=60)
    try:
        assert _answer(b, messages).hit == "miss"  # the remote holds it, too slowly: prefilled
        stats = b.store.remote_stats()
        assert stats["walks"] == 1 and stats["timeout"] == 1 and stats["hits"] == 0
        assert stats["breaker_opens"] == 1 and stats["skipped"] >= 1  # the request's walk again stays local
        assert proxy.bytes_down < smallest / 4  # the fetch stopped long before its blob's end
        assert _answer(b, messages).hit == "exact" and b.store.remote_stats()["walks"] == 1  # local now
        assert _intact(b.store) == 3
    finally:
        proxy.stop()
        b.close()


def test_a_flipped_byte_in_a_remote_blob(adapter, tmp_path, system_prompts, redis_server):
    prefix, messages = new_prefix("flipped"), _messages(system_prompts, 0)
    a = _node(adapter, tmp_path, "a", redis_server.url, prefix)
    _answer(a, messages)
    assert a.store.flush(30)
    keys = [k for k, _h, _l, _n in sorted(a.store.local.iterate(), key=lambda row: row[1].token_start)]
    a.close()
    r = redis.Redis.from_url(redis_server.url)
    blob_key = f"{prefix}:{{{keys[1].hex()}}}:b"  # the middle chunk, [128, 256)
    at = r.strlen(blob_key) // 2
    r.setrange(blob_key, at, bytes([r.getrange(blob_key, at, at)[0] ^ 0x10]))
    b = _node(adapter, tmp_path, "b", redis_server.url, prefix)
    try:
        got = _answer(b, messages)
        assert got.hit == "partial" and got.tokens_reused == 128  # up to the refused chunk
        assert b.store.remote_stats()["corrupt"] == 1 and b.store.dropped_corrupt == 1
        assert b.store.flush(30) and _intact(b.store) == 3
        c = _node(adapter, tmp_path, "c", redis_server.url, prefix)  # node B stored the chunk again
        assert _answer(c, messages).hit == "exact" and c.store.remote_stats()["corrupt"] == 0
        c.close()
    finally:
        b.close()


def test_a_full_remote_with_noeviction(adapter, tmp_path, system_prompts):
    server = RedisServer(tmp_path / "redis", args=("--maxmemory", "6mb", "--maxmemory-policy", "noeviction")).start()
    prefix, messages = new_prefix("full"), _messages(system_prompts, 0)
    a = _node(adapter, tmp_path, "a", server.url, prefix)
    try:
        assert _answer(a, messages).hit == "miss"
        assert a.store.flush(30)
        assert _answer(a, messages).hit == "exact"
        assert a.store.flush(30)
        stats = a.store.remote_stats()
        assert stats["oom"] >= 1 and stats["errors"] == stats["oom"] and stats["breaker_opens"] == 0
        assert _intact(a.store) == 3
        b = _node(adapter, tmp_path, "b", server.url, prefix)  # reads go on while the server is full
        got = _answer(b, messages)
        assert got.tokens_reused == 128 * b.store.remote_stats()["hits"]
        b.close()
    finally:
        a.close()
        server.stop()
