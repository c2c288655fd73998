"""The store's core: the LMDB environment and key layout (``store``), the blob format
(``codec``), the prefix walk (``walk``) and cross-process locks (``locks``). The modules of this
package implement one thing together; everything above uses only their public names."""
