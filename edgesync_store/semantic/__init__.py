"""Finding stored prompts by meaning: MiniLM embedders, the vectors kept in the store, the HNSW
sidecar index over them, donor records (a stored prompt's token IDs and embedded text) and
re-embedding a store."""
