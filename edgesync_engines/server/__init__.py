"""``edgesync serve``: an OpenAI-compatible HTTP server over :class:`~edgesync_engines.request.router.EdgeSync`.

Modules: :mod:`.app` (the FastAPI application and its routes), :mod:`.schemas` (request and
response models), :mod:`.pool` (the worker processes, seen from the server), :mod:`.worker`
(one engine in one process), :mod:`.parent_watch` (a worker stops once its server is gone),
:mod:`.capacity` (the worker count against memory and CPUs), :mod:`.metrics` (Prometheus),
:mod:`.errors` (the OpenAI error shape) and :mod:`.security` (API key, body size, bind address).
"""

from edgesync_store.errors import require_extra

SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client")
"""The modules of the ``server`` extra (pyproject.toml): importing this package without one of
them raises :class:`~edgesync_store.errors.MissingExtraError`, one line naming the extra."""

for module in SERVER_MODULES:
    require_extra(module, "server", "edgesync serve")
del module
