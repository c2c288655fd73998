"""Finding stored prompts by meaning: embedders, vectors in LMDB, the HNSW index, donors, reindex."""
