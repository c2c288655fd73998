"""Finding stored prompts by meaning.

* ``embedders``: MiniLM-L6-v2 embedders by name (``embedder_base``, ``onnx_embedder``,
  ``st_embedder``);
* ``vectors``: the vectors kept in the store's LMDB environment (``vector_records``: their
  value types and checks);
* ``index``: the HNSW index over them (``graph``: the hnswlib graph and its labels' keys;
  ``sidecar``: its saved files);
* ``donors``: a stored prompt's token IDs and embedded text; ``reindex``: re-embedding a store.
"""
