"""``edgesync serve``: an OpenAI-compatible HTTP server over ``EdgeSync``, one engine per worker
process."""

from edgesync_store.errors import require_extra

SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client")
"""The modules of the ``server`` extra; without one, importing this package raises
:class:`~edgesync_store.errors.MissingExtraError`."""

for module in SERVER_MODULES:
    require_extra(module, "server", "edgesync serve")
del module
