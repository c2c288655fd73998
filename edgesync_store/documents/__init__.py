"""Documents an application adds on purpose: their records (``records``), their fragments'
lifetime and the HNSW index that retrieves them by meaning (``retrieval``)."""
