"""``edgesync serve``: an OpenAI-compatible HTTP server over ``EdgeSync``, one engine per worker
process."""

from importlib.util import find_spec

from edgesync_store.errors import MissingExtraError

SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client")
"""The modules of the ``server`` extra; without one, importing this package raises
:class:`~edgesync_store.errors.MissingExtraError`. They are looked up, not imported: a worker
process needs none of them, and the server imports them while its workers load
(``app/cli_serve.py``, with ``require_extra``)."""

for module in SERVER_MODULES:
    if find_spec(module) is None:
        raise MissingExtraError("edgesync serve", "server", module)
del module
