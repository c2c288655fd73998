"""Model file fingerprints: SHA-256 of the file, computed once per (path, size, mtime).

Hashing a 98 MB GGUF takes a fraction of a second but every start would pay it, so the digest is
cached in a small JSON file (``fingerprints.json`` in the per-user cache directory, or
``EDGESYNC_FINGERPRINT_CACHE``) keyed by the resolved path, size in bytes and mtime in ns; a
changed size or mtime re-hashes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import platformdirs

log = logging.getLogger("edgesync.fingerprint")
_lock = threading.Lock()
_memo: dict[tuple[str, int, int], str] = {}


def cache_file() -> Path:
    """Where fingerprints are cached (``EDGESYNC_FINGERPRINT_CACHE`` overrides)."""
    override = os.environ.get("EDGESYNC_FINGERPRINT_CACHE")
    if override:
        return Path(override)
    return Path(platformdirs.user_cache_dir("edgesync")) / "fingerprints.json"


def _hash_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_fingerprint(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of a file's bytes, cached by (resolved path, size, mtime_ns).

    Raises:
        FileNotFoundError: the file does not exist.
    """
    resolved = Path(path).resolve()
    st = resolved.stat()
    memo_key = (str(resolved), st.st_size, st.st_mtime_ns)
    with _lock:
        if memo_key in _memo:
            return _memo[memo_key]
        store = cache_file()
        entries: dict = {}
        try:
            entries = json.loads(store.read_text())
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):
            entries = {}
        entry = entries.get(str(resolved))
        if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
            digest = str(entry.get("sha256", ""))
            if len(digest) == 64:
                _memo[memo_key] = digest
                return digest
        log.info("fingerprinting %s (%d bytes)", resolved, st.st_size)
        digest = _hash_file(resolved)
        entries[str(resolved)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=store.parent, delete=False, suffix=".tmp") as tmp:
                json.dump(entries, tmp)
            os.replace(tmp.name, store)
        except OSError as exc:
            log.warning("cannot cache the fingerprint in %s: %s", store, exc)
        _memo[memo_key] = digest
        return digest
