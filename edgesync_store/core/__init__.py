"""The store's core: the storage seam and its LMDB implementation.

* ``backend``: :class:`FragmentBackend`, the abstract interface the layers above use (what a
  second backend, e.g. a shared remote tier, implements);
* ``store``: :class:`FragmentStore`, the local backend on LMDB; ``store_lifecycle``: its
  lifecycle-record and maintenance methods;
* ``lmdb_env``: the LMDB environment, database names and key layout, transactions that grow
  the map;
* ``companions``: the records the semantic layer keys by fragment (donors, vectors), which the
  store deletes and re-keys with their fragments;
* ``codec``: the blob format; ``walk``: the prefix index's queries; ``locks``: cross-process
  locks and pins; ``crashpoints``: kill points for the crash-safety tests.

The modules of this package implement one thing together (they may use each other's
underscore names); everything above uses only their public names.
"""
