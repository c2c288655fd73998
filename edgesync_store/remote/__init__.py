"""The shared remote tier: Redis 7 or Valkey (standalone or Cluster) behind the local store.
Importing this package loads no client; its modules need redis-py (the ``remote`` extra)."""
