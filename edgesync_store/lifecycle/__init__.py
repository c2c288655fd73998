"""Store maintenance: eviction under the size budget, merging and splitting fragments, disk
reclaim by compact copy, and the scheduled jobs. The lifetime policy itself is ``edgesync_store.ttl``
and the orchestration ``edgesync_store.compactor``."""
