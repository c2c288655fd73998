"""One node of a site, run in a fresh interpreter by the remote-tier tests: EdgeSync on its own
local store with the shared remote tier of the environment (``EDGESYNC_REMOTE_URL`` ...).
Answers each chat request uncached first (same engine, no store), then through EdgeSync, and
prints one JSON line per request: the EdgeSync result, the uncached tokens and TTFT, and what
the remote tier did for it (counter differences). Closing waits for the queued remote writes.

Usage: python tests/proc_remote_node.py STORE REQUESTS.json MAX_TOKENS
"""

from __future__ import annotations

import json
import sys

from edgesync_engines.request.router import EdgeSync


def main() -> int:
    store, requests_file, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    requests = json.loads(open(requests_file).read())
    with EdgeSync(store=store) as es:
        baseline = EdgeSync(es.adapter, store=False, config=es.config)
        for messages in requests:
            uncached = baseline.generate(messages, max_tokens=max_tokens)
            before = es.store.remote_stats()
            result = es.generate(messages, max_tokens=max_tokens)
            after = es.store.remote_stats()
            row = result.to_dict()
            row["uncached_tokens"], row["uncached_ttft_ms"] = uncached.tokens, uncached.ttft_ms
            row["remote"] = {k: after[k] - before[k] for k in ("hits", "bytes_fetched", "walks", "errors")}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
