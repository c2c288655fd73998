"""The server's Prometheus metrics (``GET /metrics``, through prometheus-client).

Every name is prefixed ``edgesync_`` (docs/serving.md, Metrics). Error answers of every layer
are counted by :class:`ErrorCounter`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Histogram bounds of ``edgesync_ttft_seconds``, seconds."""
IDLE_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Histogram bounds of ``edgesync_idle_wait_seconds``, seconds (one batch: 1 ms to 1 s)."""

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The ``Content-Type`` of :meth:`ServerMetrics.render`."""


def store_disk_bytes(store: Path) -> int:
    """Bytes of the store's LMDB files (0 when the directory holds none yet)."""
    try:
        return sum(p.stat().st_size for p in Path(store).glob("*.mdb"))
    except OSError:
        return 0


class _ReadCounters:
    """Counters whose values the pool keeps (``(name, help, read)``, ``read()`` the total so
    far), exposed as counters (``NAME_total``) when ``/metrics`` is read."""

    def __init__(self, counters: list[tuple[str, str, Callable[[], int]]]) -> None:
        self.counters = counters

    def collect(self):
        for name, doc, read in self.counters:
            yield CounterMetricFamily(name, doc, value=read())


class ServerMetrics:
    """The metrics of one server, in their own registry.

    Args:
        store: the store directory (for ``store_bytes``).
        workers, restarts, queued, cancelled, routed, handed_over, slots: callables returning the
            pool's counts; idle: -> ``WorkerPool.idle_totals()``.
    """

    def __init__(self, store: Path, workers: Callable[[], int], restarts: Callable[[], int],
                 queued: Callable[[], int], cancelled: Callable[[], int],
                 idle: Callable[[], dict] = dict, routed: Callable[[], int] = int,
                 handed_over: Callable[[], int] = int, slots: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("edgesync_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("edgesync_prompt_tokens", "prompt tokens of answered requests", registry=r)
        self.cached_tokens = Counter("edgesync_cached_prompt_tokens",
                                     "prompt tokens reused: the live sequence's, or injected from the store",
                                     registry=r)
        self.completion_tokens = Counter("edgesync_completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("edgesync_ttft_seconds", "request received to first token, seconds",
                              buckets=TTFT_BUCKETS, registry=r)
        self.hits = Counter("edgesync_hits", "answered requests by hit kind", ["kind"], registry=r)
        Gauge("edgesync_store_bytes", "bytes of the fragment store on disk", registry=r).set_function(
            lambda: store_disk_bytes(store))
        Gauge("edgesync_workers", "engine worker processes", registry=r).set_function(workers)
        Gauge("edgesync_slots", "conversations the workers answer at once, in all", registry=r).set_function(
            slots or workers)
        self.slot_requests = Counter("edgesync_slot_requests", "answered requests by worker and slot",
                                     ["worker", "slot"], registry=r)
        self.slot_tokens = Counter("edgesync_slot_tokens", "tokens of answered requests by worker, slot and kind: "
                                   "prompt, cached (of the prompt's), completion", ["worker", "slot", "kind"],
                                   registry=r)
        Gauge("edgesync_queued_requests", "requests sent to a worker and not answered yet",
              registry=r).set_function(queued)
        r.register(_ReadCounters([
            ("edgesync_worker_restarts", "worker processes restarted after dying", restarts),
            ("edgesync_cancelled_requests", "requests stopped early because the client went away", cancelled),
            ("edgesync_idle_tokens_prefilled", "tokens the workers prefilled and stored between requests",
             lambda: idle().get("tokens_prefilled", 0)),
            ("edgesync_idle_tokens_wasted", "tokens prefilled between requests that the next request did not "
             "begin with", lambda: idle().get("tokens_wasted", 0)),
            ("edgesync_routed_by_prefix", "requests sent to the worker whose live conversation begins them", routed),
            ("edgesync_handed_over", "conversations moved to another worker: a new one took their worker "
             "while it was storing them", handed_over),
        ]))
        self.live_prefix = Counter("edgesync_live_prefix_requests", "answered requests that continued their "
                                   "worker's live sequence (nothing injected for that part)", registry=r)
        self.idle_wait = Histogram("edgesync_idle_wait_seconds", "wait for idle-time work to stop, "
                                   "seconds (requests that found it running)", buckets=IDLE_WAIT_BUCKETS, registry=r)

    def answered(self, endpoint: str, result: dict, ttft_s: float) -> None:
        """Count one answer (``result``: the worker's ``done`` fields)."""
        self.requests.labels(endpoint, "200").inc()
        self.prompt_tokens.inc(result["prompt_tokens"])
        self.cached_tokens.inc(result["tokens_reused"])
        self.completion_tokens.inc(result["completion_tokens"])
        self.hits.labels(result["hit"]).inc()
        where = (str(result.get("worker", 0)), str(result.get("slot", 0)))
        self.slot_requests.labels(*where).inc()
        for kind, field in (("prompt", "prompt_tokens"), ("cached", "tokens_reused"),
                            ("completion", "completion_tokens")):
            self.slot_tokens.labels(*where, kind).inc(result[field])
        self.ttft.observe(max(0.0, ttft_s))
        if result.get("live_tokens", 0) > 0:
            self.live_prefix.inc()
        if result.get("idle_wait_ms") is not None:
            self.idle_wait.observe(max(0.0, result["idle_wait_ms"] / 1000))

    def failed(self, endpoint: str, status: int) -> None:
        """Count one request answered with an error status."""
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class ErrorCounter:
    """ASGI middleware counting every error answer (status >= 400) in ``requests_total`` by endpoint
    (``endpoints``, else ``other``) and status; outermost, so it sees every layer's errors."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: tuple[str, ...]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"

        async def counted(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.failed(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counted)
