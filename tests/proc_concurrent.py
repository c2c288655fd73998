"""One of two processes of the concurrency test: for DURATION seconds, answer seed-workload
requests through EdgeSync on a shared store, each also uncached, and count disagreements.

Usage: python tests/proc_concurrent.py STORE WORKER DURATION_S (and at least MIN_REQUESTS requests)
Worker w takes the seed workload's requests w, w+2, w+4, ... so the two processes share topics
(and so write and read the same prefixes) without walking in lockstep. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

from edgesync_bench import workloads
from edgesync_engines.request.router import EdgeSync

MIN_REQUESTS = 4
"""Each process answers at least this many requests, however slow the machine."""


def main() -> int:
    store, worker, duration = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    requests = workloads.seed_workload(1000)[worker::2]
    report = {"worker": worker, "requests": 0, "mismatches": [], "hits": {}}
    with EdgeSync(store=store) as es:
        uncached = EdgeSync(es.adapter, store=False)
        deadline = time.monotonic() + duration
        for req in requests:
            if time.monotonic() > deadline and report["requests"] >= MIN_REQUESTS:
                break
            cached = es.generate(req.as_messages(), max_tokens=8)
            plain = uncached.generate(req.as_messages(), max_tokens=8)
            report["requests"] += 1
            report["hits"][cached.hit] = report["hits"].get(cached.hit, 0) + 1
            if cached.tokens != plain.tokens:
                report["mismatches"].append(req.request_id)
        report["store_fragments"] = es.store.stats().fragments
        report["dropped_corrupt"] = es.store.stats().dropped_corrupt
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
