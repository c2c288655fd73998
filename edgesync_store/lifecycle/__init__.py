"""Store maintenance: ``eviction`` under the size budget, ``merge`` (cutting fragments into
layer/head groups and joining them back), ``reclaim`` (disk space back by a compact copy) and
``jobs`` (the scheduled sweep and compaction). The lifetime policy itself is
``edgesync_store.ttl`` and one compaction run ``edgesync_store.compactor``."""
