"""``edgesync serve``: an OpenAI-compatible HTTP server over :class:`~edgesync_engines.request.router.EdgeSync`.

Modules: :mod:`.app` (the FastAPI application and its routes), :mod:`.schemas` (request and
response models), :mod:`.pool` (the worker processes, seen from the server), :mod:`.worker`
(one engine in one process), :mod:`.stops` (stop sequences), :mod:`.metrics` (Prometheus),
:mod:`.errors` (the OpenAI error shape) and :mod:`.security` (API key, body size, bind address).
"""
