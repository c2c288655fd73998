"""The semantic index's sidecar files: ``semantic.hnsw`` (``hnswlib.Index.save_index``) and
``semantic.json`` (backend id, dim, space and graph parameters, ``index_id``, generation, live
count, deleted labels, size and SHA-256 of the graph). Written atomically (temp file, fsync,
``os.replace``; graph first, under ``semantic.lock``), mode 0600; a graph the JSON does not
vouch for is never loaded."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from edgesync_store.core.lmdb_env import fsync_dir

__all__ = ["EF_CONSTRUCTION", "HNSW_M", "SIDECAR_FORMAT", "SIDECAR_HNSW", "SIDECAR_JSON", "SIDECAR_LOCK", "SPACE",
           "file_lock", "header", "load_graph", "save_graph"]

HNSW_M = 16
"""hnswlib M (graph out-degree)."""
EF_CONSTRUCTION = 200
"""hnswlib ef_construction."""
SPACE = "ip"
"""hnswlib space: inner product on unit vectors; hnswlib distance = 1 - cosine."""
SIDECAR_HNSW = "semantic.hnsw"
SIDECAR_JSON = "semantic.json"
SIDECAR_LOCK = "semantic.lock"
SIDECAR_FORMAT = 1


def header(backend_id: str, dim: int, index_id: str) -> dict[str, Any]:
    """The fields of ``semantic.json`` that must match for a saved graph to be used."""
    return {"format": SIDECAR_FORMAT, "backend_id": backend_id, "dim": dim, "space": SPACE, "M": HNSW_M,
            "ef_construction": EF_CONSTRUCTION, "index_id": index_id}


@contextmanager
def file_lock(directory: Path, shared: bool) -> Iterator[None]:
    """``flock`` on ``semantic.lock`` (shared to read the sidecar, exclusive to write it); no
    lock in a directory we cannot write (nobody can be writing there)."""
    try:
        fd = os.open(Path(directory) / SIDECAR_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _atomic_write(directory: Path, target: Path, write: Callable[[str], None]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load_graph(hnswlib, directory: Path, expected: dict[str, Any], max_generation: int):
    """Load the saved graph when ``semantic.json`` vouches for it (:func:`header` fields equal
    ``expected``, size and hash match, generation not above ``max_generation``). Returns ``(graph,
    generation, deleted labels)``.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a field or the graph disagrees.
        OSError, RuntimeError: reading or hnswlib's load failed.
    """
    directory = Path(directory)
    with file_lock(directory, shared=True):
        info = json.loads((directory / SIDECAR_JSON).read_text())
        if not isinstance(info, dict):
            raise ValueError("semantic.json is not an object")
        for name, value in expected.items():
            if info.get(name) != value:
                raise ValueError(f"{name} is {info.get(name)!r}, expected {value!r}")
        data = (directory / SIDECAR_HNSW).read_bytes()
        if len(data) != info.get("hnsw_bytes") or hashlib.sha256(data).hexdigest() != info.get("hnsw_sha256"):
            raise ValueError(f"{SIDECAR_HNSW} is {len(data)} bytes and does not match the size and hash recorded")
        del data
        generation = info.get("generation")
        if not isinstance(generation, int) or generation > max_generation:
            raise ValueError(f"generation {generation!r} is ahead of the store's")
        deleted = info.get("deleted_labels")
        if not isinstance(deleted, list) or not all(isinstance(x, int) for x in deleted):
            raise ValueError("deleted_labels is not a list of integers")
        graph = hnswlib.Index(space=SPACE, dim=expected["dim"])
        graph.load_index(str(directory / SIDECAR_HNSW), max_elements=0, allow_replace_deleted=True)
    return graph, generation, deleted


def save_graph(directory: Path, graph, info: dict[str, Any]) -> None:
    """Write ``graph`` to ``semantic.hnsw`` and ``info`` (with the graph's size and SHA-256
    and the time saved) to ``semantic.json``, atomically, under the exclusive lock."""
    directory = Path(directory)
    with file_lock(directory, shared=False):
        digest = {}

        def write_graph(tmp: str) -> None:
            graph.save_index(tmp)
            h = hashlib.sha256()
            size = 0
            with open(tmp, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    size += len(chunk)
            digest.update(hnsw_bytes=size, hnsw_sha256=h.hexdigest())

        _atomic_write(directory, directory / SIDECAR_HNSW, write_graph)
        doc = {**info, **digest, "saved_at": time.time()}

        def write_json(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=1)

        _atomic_write(directory, directory / SIDECAR_JSON, write_json)
        try:
            fsync_dir(directory)
        except OSError:
            pass
