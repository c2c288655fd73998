"""The store's core: the storage seams (``backend``) and their LMDB implementation (``store``),
the blob format (``codec``), the prefix walk (``walk``), locks and pins (``locks``). It imports
nothing above it; the module table is in ``docs/architecture.md``.
"""
