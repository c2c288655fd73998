"""Run in a fresh interpreter by the tests: answer chat requests through EdgeSync on a store and
print one JSON line per request, with llama.cpp's own perf counters.

Usage: python tests/proc_request.py STORE REQUESTS.json MAX_TOKENS
REQUESTS.json holds a list of chat-message lists.
"""

from __future__ import annotations

import json
import sys

from edgesync_engines.request.router import EdgeSync


def main() -> int:
    store, requests_file, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    requests = json.loads(open(requests_file).read())
    with EdgeSync(store=store) as es:
        for messages in requests:
            es.adapter.reset_perf()
            result = es.generate(messages, max_tokens=max_tokens)
            row = result.to_dict()
            row["perf"] = es.adapter.perf_counts()
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
