"""The shared remote tier: Redis 7 or Valkey (standalone or Cluster) behind the local store.

Modules: ``url`` (the URL and its redaction, credentials; imports no client library),
``client`` (redis-py clients, timeouts, the circuit breaker, counters), ``tier`` (the key
layout and the commands), ``walk`` (the prefix walk over the remote index), ``queue`` (the
write-behind queue) and ``tiered`` (``TieredStore``: the storage seams over both tiers).
Importing this package loads no client; ``tiered`` and ``client`` need redis-py (the ``remote``
extra).
"""
