"""``python -m edgesync_bench.remote``: two nodes of a site with and without the shared remote tier,
and the remote index at scale. Not a test (never run by CI); prints a table and writes JSON.

Two node processes (this module with ``--node``: EdgeSync on a local store of its own, the
real SmolLM2 through llama.cpp, one thread each) answer the seed workload's first ``--limit``
requests, round robin (request i to node i mod 2, one at a time), twice:

* ``local``: each node on its own local store only;
* ``shared``: the same, with one Redis (a redis-server this script starts on a free loopback
  port, tools/redis_servers.py) as the shared remote tier behind both.

Per mode: hits by source (``local``: KV injected from the node's own store only; ``remote``:
at least one fragment fetched from the remote tier; ``miss``: nothing injected), mean TTFT
overall and by source, and the bytes over the network (the server's own ``INFO stats``
``total_net_input_bytes`` + ``total_net_output_bytes``, and the tier's fetched and written
bytes). Answers are compared between the modes (they must be identical: both are exact mode).

Scale (``--scale-fragments N``, default 100,000): N synthetic index entries (heads of 128-token
fragments of a one-layer namespace, each under its own prefix, as a chain of new prompts
writes them) are added to the remote index; the server's ``used_memory`` per entry is measured
and multiplied out to 1 million fragments, and the time of a remote walk (a 3-chunk prompt,
cold local store) is measured before and after (a walk reads only its own prefixes' hashes:
its cost should not grow with N). The blobs of 1 million real fragments are reckoned on paper
from the measured blob size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from the checkout
    sys.path.insert(0, str(ROOT))

MAX_TOKENS = 16
SOURCES = ("local", "remote", "miss")


def node_main(store: str) -> int:
    """``--node STORE``: answer JSON chat-message lists from stdin, one JSON line each on stdout."""
    from edgesync_engines.request.router import EdgeSync

    with EdgeSync(store=store) as es:
        remote = getattr(es.store, "remote_stats", None)
        for line in sys.stdin:
            messages = json.loads(line)
            before = remote() if remote else {}
            r = es.generate(messages, max_tokens=MAX_TOKENS)
            after = remote() if remote else {}
            delta = {k: after[k] - before[k] for k in ("hits", "bytes_fetched", "errors")} if remote else {}
            print(json.dumps({"hit": r.hit, "tokens": r.tokens, "ttft_ms": r.ttft_ms,
                              "prompt_tokens": r.prompt_tokens, "tokens_reused": r.tokens_reused,
                              "bytes_read": r.bytes_read, "remote": delta}), flush=True)
        if remote:
            es.store.flush(30)
            print(json.dumps({"final": remote()}), flush=True)
    return 0


def _source(row: dict) -> str:
    if row["remote"].get("hits"):
        return "remote"
    return "local" if row["tokens_reused"] else "miss"


def run_mode(requests: list, workdir: Path, url: str | None, prefix: str) -> dict:
    """Both nodes on the requests, round robin; per-request rows and the nodes' final counters."""
    env = {**os.environ, "EDGESYNC_THREADS": "1", "EDGESYNC_SEMANTIC": "0", "EDGESYNC_JOBS": "0",
           "EDGESYNC_REMOTE_PREFIX": prefix}
    env.pop("EDGESYNC_REMOTE_URL", None)
    if url:
        env["EDGESYNC_REMOTE_URL"] = url
    nodes = [subprocess.Popen([sys.executable, "-m", "edgesync_bench.remote", "--node", str(workdir / f"node{i}")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for i in range(2)]
    rows = []
    for i, req in enumerate(requests):
        node = nodes[i % 2]
        node.stdin.write(json.dumps(req.as_messages()) + "\n")
        node.stdin.flush()
        row = json.loads(node.stdout.readline())
        rows.append({**row, "node": i % 2, "request_id": req.request_id, "source": _source(row)})
    finals = []
    for node in nodes:
        node.stdin.close()
        tail = [json.loads(line) for line in node.stdout.read().splitlines() if line.startswith("{")]
        finals.append(next((t["final"] for t in tail if "final" in t), {}))
        node.wait(timeout=120)
    return {"rows": rows, "nodes": finals}


def summarize(mode: dict, net_bytes: int | None) -> dict:
    rows = mode["rows"]
    ttft = [r["ttft_ms"] for r in rows]
    by = {s: [r["ttft_ms"] for r in rows if r["source"] == s] for s in SOURCES}
    finals = mode["nodes"]
    return {
        "requests": len(rows),
        "hits_by_source": {s: len(by[s]) for s in SOURCES},
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "ttft_mean_ms_by_source": {s: (statistics.fmean(v) if v else None) for s, v in by.items()},
        "bytes_fetched": sum(f.get("bytes_fetched", 0) for f in finals),
        "bytes_written": sum(f.get("bytes_written", 0) for f in finals),
        "remote_errors": sum(f.get("errors", 0) for f in finals),
        "queue_drops": sum(f.get("queue_drops", 0) for f in finals),
        "network_bytes": net_bytes,
    }


def _net_bytes(client) -> int:
    info = client.info("stats")
    return int(info["total_net_input_bytes"]) + int(info["total_net_output_bytes"])


def scale(url: str, n: int, walks: int = 20) -> dict:
    """Index memory per fragment and remote walk cost, before and after ``n`` synthetic entries."""
    import numpy as np
    import redis

    from edgesync_store.core import codec
    from edgesync_store.core.store import FragmentStore
    from edgesync_store.remote.tier import head_of
    from edgesync_store.remote.tiered import TieredStore
    from edgesync_store.schema import KVFragment, Namespace, chunk_spans, prefix_hash

    ns = Namespace("ab" * 32, "llama.cpp", "llama-cpp-python 0.3.36", "f16", False, "scale", 1, 1, 32, "bench")
    rng = np.random.default_rng(0)
    prefix = "scale"

    def chain(tokens):
        out = []
        for s, e in chunk_spans(len(tokens) - 1, 128):
            k = rng.standard_normal((1, e - s, 32)).astype(np.float16)
            out.append(KVFragment(ns, s, e, 0, 1, k, k.copy(), np.asarray(tokens[s:e], np.int32),
                                  prefix_hash(tokens[:s])))
        return out

    def walk_ms(store_dir: Path, prompts) -> float:
        times = []
        with TieredStore.connect(FragmentStore(store_dir), url, prefix=prefix, timeout_ms=1000) as store:
            for tokens in prompts:
                t0 = time.perf_counter()
                if store.prefix_walk(ns, tokens).matched_tokens != len(tokens) - 1:
                    raise RuntimeError("the scale walk did not find its prompt")
                times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    tmp = Path(tempfile.mkdtemp(prefix="edgesync-remote-scale-"))
    prompts = [[int(t) for t in rng.integers(0, 49000, 342)] for _ in range(walks)]
    with TieredStore.connect(FragmentStore(tmp / "writer"), url, prefix=prefix, timeout_ms=1000) as writer:
        for tokens in prompts:
            writer.put_many(chain(tokens))
        writer.flush(60)
    before = walk_ms(tmp / "cold0", prompts)
    r = redis.Redis.from_url(url)
    head = codec.peek(head_of(codec.encode(chain(prompts[0])[0])))
    template = head_of(codec.encode(chain(prompts[0])[0]))
    mem0 = int(r.info("memory")["used_memory"])
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        fake = i.to_bytes(8, "little") * 4
        pipe.hset(f"{prefix}:i:{ns.digest().hex()}{fake.hex()}", fake, template)
        if len(pipe) >= 2000:
            pipe.execute()
    pipe.execute()
    per_entry = (int(r.info("memory")["used_memory"]) - mem0) / n
    after = walk_ms(tmp / "cold1", prompts)
    return {"synthetic_entries": n, "index_bytes_per_fragment": per_entry, "head_bytes": len(template),
            "index_bytes_at_1m": per_entry * 1_000_000, "walk_ms_median_before": before,
            "walk_ms_median_after": after, "span_tokens": head.token_end - head.token_start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgesync_bench.remote", description=__doc__.split("\n\n")[0])
    parser.add_argument("--node", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, default=40, help="seed requests (default 40)")
    parser.add_argument("--scale-fragments", type=int, default=100_000, help="synthetic index entries (0: skip)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    if args.node:
        return node_main(args.node)
    import redis

    from edgesync_bench.workloads import seed_workload
    from tools.redis_servers import RedisServer

    requests = seed_workload(args.limit)
    work = Path(tempfile.mkdtemp(prefix="edgesync-remote-bench-"))
    server = RedisServer(work / "redis").start()
    out: dict = {"limit": args.limit, "max_tokens": MAX_TOKENS}
    try:
        client = redis.Redis.from_url(server.url)
        modes = {}
        for name, url in (("local", None), ("shared", server.url)):
            before = _net_bytes(client)
            modes[name] = run_mode(requests, work / name, url, f"bench-{name}")
            out[name] = summarize(modes[name], _net_bytes(client) - before)
        out["identical_answers"] = all(a["tokens"] == b["tokens"] for a, b in
                                       zip(modes["local"]["rows"], modes["shared"]["rows"]))
        hits = sum(f.get("hits", 0) for f in modes["shared"]["nodes"])
        blob = out["shared"]["bytes_fetched"] / hits if hits else None
        out["mean_blob_bytes_fetched"] = blob
        if args.scale_fragments:
            out["scale"] = scale(server.url, args.scale_fragments)
            out["scale"]["blob_bytes_at_1m"] = blob * 1_000_000 if blob else None
    finally:
        server.stop()
    text = json.dumps(out, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
