"""Run in a fresh interpreter by tests/test_concurrent_compact.py: serve chat requests through
EdgeSync on a store until a stop file appears, printing one JSON line per request.

Usage: python tests/proc_serve.py STORE REQUESTS.json STOP_FILE MAX_TOKENS TTL_SECONDS MAX_BYTES
REQUESTS.json: {"prompts": [chat-message lists], "once": [prompt indices], "once_ttl_seconds": s,
"order": [prompt indices]}: the "once" prompts are answered first, one time each, storing
fragments that live only ``once_ttl_seconds``; then the order is cycled.

EdgeSync objects share one engine and one store (opened by the first with the TTL and the size
budget): even requests of the order store each chunk as two layer halves
(layers_per_fragment=15), odd ones as 2 x 3 layer x KV-head groups (heads_per_fragment=1 as
well), so a compactor running beside this process always has merges to do. Store jobs are off:
the other process compacts.

Lines printed: {"ready": true} once the engine is loaded; then per request {"i", "prompt",
"grouping", "hit", "tokens", "tokens_reused", "prompt_tokens", "fragments_written"}; at the end
{"done": true, "requests", "evictions", "evicted_fragments", "dropped_corrupt", "fragments"}.
Evictions are counted from the store's own log record of each eviction made while writing.
Log records of WARNING and above go to stderr with their level name.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync

SAFETY_S = 240.0
"""Stop by itself this long after start, should the stop file never come."""


class _EvictionCounter(logging.Handler):
    """Counts ``eviction.evict_in``'s INFO record ("size budget ...: evicted N fragments")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.evictions = 0
        self.fragments = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("size budget") and record.args:
            self.evictions += 1
            self.fragments += int(record.args[1])


def main() -> int:
    store, requests_file, stop_file = sys.argv[1], sys.argv[2], sys.argv[3]
    max_tokens, ttl, max_bytes = int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    counter = _EvictionCounter()
    store_log = logging.getLogger("edgesync_store")
    store_log.addHandler(counter)
    store_log.setLevel(logging.INFO)  # the eviction record is INFO; the root handler still shows WARNING+
    logging.getLogger().handlers[0].setLevel(logging.WARNING)
    spec = json.loads(open(requests_file).read())
    prompts, order = spec["prompts"], spec["order"]
    common = {"jobs": False, "ttl_seconds": ttl, "max_bytes": max_bytes, "layers_per_fragment": 15}
    t0 = time.monotonic()
    with EdgeSync(store=store, config=EdgeSyncConfig.load(common)) as halves:
        grid = EdgeSync(halves.adapter, store=halves.store,
                        config=EdgeSyncConfig.load({**common, "heads_per_fragment": 1, "semantic": False}))
        brief = EdgeSync(halves.adapter, store=halves.store,
                         config=EdgeSyncConfig.load({**common, "ttl_seconds": spec["once_ttl_seconds"],
                                                     "semantic": False}))
        print(json.dumps({"ready": True}), flush=True)
        schedule = [(idx, brief, "layers, once") for idx in spec["once"]]
        n = 0
        while not os.path.exists(stop_file) and time.monotonic() - t0 < SAFETY_S:
            if n < len(schedule):
                idx, es, grouping = schedule[n]
            else:
                idx = order[(n - len(schedule)) % len(order)]
                es, grouping = (halves, "layers") if n % 2 == 0 else (grid, "layers x heads")
            result = es.generate(prompts[idx], max_tokens=max_tokens)
            print(json.dumps({"i": n, "prompt": idx, "grouping": grouping, "hit": result.hit,
                              "tokens": result.tokens, "tokens_reused": result.tokens_reused,
                              "prompt_tokens": result.prompt_tokens,
                              "fragments_written": result.fragments_written}), flush=True)
            n += 1
        grid.close()
        brief.close()
        stats = halves.store.stats()
        print(json.dumps({"done": True, "requests": n, "evictions": counter.evictions,
                          "evicted_fragments": counter.fragments, "dropped_corrupt": stats.dropped_corrupt,
                          "fragments": stats.fragments}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
