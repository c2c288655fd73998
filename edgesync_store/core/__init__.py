"""The store's core: the storage seams and their LMDB implementation.

* ``backend``: :class:`FragmentBackend`, the request path's interface, and
  :class:`MaintenanceBackend`, which extends it for maintenance (what a second backend, e.g. a
  shared remote tier, implements);
* ``store``: :class:`FragmentStore`, the local backend on LMDB; ``chain_read``: what its
  in-place reads yield;
* ``lmdb_env``: the LMDB environment, database names and key layout, transactions that grow
  the map;
* ``companions``: the records the semantic layer keys by fragment (donors, vectors), which the
  store deletes and re-keys with their fragments;
* ``codec``: the blob format; ``walk``: the prefix index's queries; ``locks``: cross-process
  locks and pins; ``crashpoints``: kill points for the crash-safety tests.
"""
