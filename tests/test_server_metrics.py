"""``GET /metrics`` of ``edgesync serve`` without a server: the idle-time, live-prefix and routing
figures come out under their names."""

from __future__ import annotations

from edgesync_engines.server.metrics import ServerMetrics


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in\n{text}")


def _result(**fields) -> dict:
    return {"prompt_tokens": 100, "tokens_reused": 90, "completion_tokens": 8, "hit": "partial",
            "live_tokens": 0, "idle_wait_ms": None, **fields}


def test_idle_live_prefix_and_routing_metrics(tmp_path):
    idle = {"tokens_prefilled": 640, "tokens_wasted": 64}
    m = ServerMetrics(tmp_path, lambda: 2, lambda: 0, lambda: 0, lambda: 0, idle=lambda: idle, routed=lambda: 3,
                      handed_over=lambda: 1)
    m.answered("/v1/chat/completions", _result(), 0.05)
    m.answered("/v1/chat/completions", _result(live_tokens=90, idle_wait_ms=4.0), 0.02)
    m.answered("/v1/chat/completions", _result(live_tokens=90, idle_wait_ms=0.5), 0.02)
    text = m.render().decode()
    assert _value(text, "edgesync_idle_tokens_prefilled_total") == 640
    assert _value(text, "edgesync_idle_tokens_wasted_total") == 64
    assert _value(text, "edgesync_routed_by_prefix_total") == 3
    assert _value(text, "edgesync_handed_over_total") == 1
    assert _value(text, "edgesync_live_prefix_requests_total") == 2
    for name in ("idle_tokens_prefilled", "idle_tokens_wasted", "routed_by_prefix", "handed_over",
                 "worker_restarts", "cancelled_requests"):  # totals the pool keeps are counters too
        assert f"# TYPE edgesync_{name}_total counter" in text
    assert _value(text, "edgesync_idle_wait_seconds_count") == 2  # a request that found no idle work: none
    assert abs(_value(text, "edgesync_idle_wait_seconds_sum") - 0.0045) < 1e-12
    assert 'edgesync_idle_wait_seconds_bucket{le="0.001"} 1.0' in text
    assert 'edgesync_idle_wait_seconds_bucket{le="0.005"} 2.0' in text
    idle["tokens_prefilled"] = 704  # read at each scrape
    assert _value(m.render().decode(), "edgesync_idle_tokens_prefilled_total") == 704


def test_defaults_without_a_pool(tmp_path):
    text = ServerMetrics(tmp_path, lambda: 1, lambda: 0, lambda: 0, lambda: 0).render().decode()
    assert _value(text, "edgesync_idle_tokens_prefilled_total") == 0
    assert _value(text, "edgesync_routed_by_prefix_total") == 0
    assert _value(text, "edgesync_handed_over_total") == 0
