"""benchmarks/chat.py's pure parts: the kind of a turn, TTFT statistics, the idle-wait histogram
read from ``/metrics`` text and its quantile, the restart gate, the ratios to their peers and
the tables (the decode rate, the numbers in flight and the model's facts:
test_chat_in_flight.py). No model, no server, no timing asserted."""

from __future__ import annotations

import math
import threading

import pytest

from edgesync_bench.chat import (
    Gate,
    histogram_buckets,
    histogram_quantile,
    merge_buckets,
    ratios,
    report,
    ttft_stats,
    turn_kind,
)

METRICS = """# HELP edgesync_idle_wait_seconds idle time before a store-back
# TYPE edgesync_idle_wait_seconds histogram
edgesync_idle_wait_seconds_bucket{le="0.5"} 2.0
edgesync_idle_wait_seconds_bucket{le="1.0"} 6.0
edgesync_idle_wait_seconds_bucket{le="2.0"} 10.0
edgesync_idle_wait_seconds_bucket{le="+Inf"} 10.0
edgesync_idle_wait_seconds_sum 9.5
edgesync_idle_wait_seconds_count 10.0
edgesync_ttft_seconds_bucket{le="0.5"} 99.0
"""


@pytest.mark.parametrize("turn, after, began_before, kind", [
    (0, False, True, "first"),
    (0, True, False, "first-after-restart"),
    (2, False, True, "later"),
    (2, True, True, "after-restart"),
    (1, True, False, "later"),  # a session begun after the restart
])
def test_turn_kind(turn, after, began_before, kind):
    assert turn_kind(turn, after, began_before) == kind


def test_ttft_stats():
    assert ttft_stats([]) is None
    s = ttft_stats([float(v) for v in range(1, 21)])
    assert s == {"mean": 10.5, "p50": 10.5, "p95": 19.0}
    assert ttft_stats([5.0]) == {"mean": 5.0, "p50": 5.0, "p95": 5.0}


def test_histogram_buckets_read_one_metric_only():
    assert histogram_buckets(METRICS, "edgesync_idle_wait_seconds") == {0.5: 2.0, 1.0: 6.0, 2.0: 10.0,
                                                                        math.inf: 10.0}
    assert histogram_buckets(METRICS, "edgesync_absent_seconds") == {}
    labelled = 'x_bucket{worker="0",le="1.0"} 1\nx_bucket{worker="1",le="1.0"} 2\n'
    assert histogram_buckets(labelled, "x") == {1.0: 3.0}


def test_histogram_quantile_interpolates_like_prometheus():
    b = histogram_buckets(METRICS, "edgesync_idle_wait_seconds")
    assert histogram_quantile(0.95, b) == pytest.approx(1.0 + 1.0 * (9.5 - 6.0) / 4.0)
    assert histogram_quantile(0.1, b) == pytest.approx(0.25)  # first bucket: from 0
    assert histogram_quantile(0.95, {1.0: 1.0, math.inf: 10.0}) == 1.0  # in +Inf: the largest finite bound
    assert histogram_quantile(0.95, {1.0: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.95, {}) is None


def test_merge_buckets_sums_the_processes():
    merged = merge_buckets({1.0: 1.0, math.inf: 2.0}, {}, {1.0: 3.0, math.inf: 3.0})
    assert merged == {1.0: 4.0, math.inf: 5.0}


def test_gate_restarts_once_half_is_answered_and_nothing_is_in_flight():
    gate = Gate(threshold=2, n_sessions=2)
    gate.resume("client-1", "m", phase="before")
    assert gate.admit() == ("client-1", "m", False)
    assert gate.admit() == ("client-1", "m", False)
    gate.answered_one()  # 1 of 2: still admitting
    assert gate.phase == "before"
    gate.answered_one()  # 2 of 2, but no session is midway: later turns would all fall after it
    assert gate.phase == "before"
    assert gate.admit()
    gate.answered_one(midway=1)  # a session has begun and goes on
    assert gate.phase == "draining" and gate.restart_due()
    admitted = []
    waiter = threading.Thread(target=lambda: admitted.append(gate.admit()))
    waiter.start()
    waiter.join(0.2)
    assert not admitted  # held while the server restarts
    gate.resume("client-2", "m")
    waiter.join(5)
    assert admitted == [("client-2", "m", True)]


def test_gate_without_restart_when_the_sessions_end_first():
    gate = Gate(threshold=5, n_sessions=1)
    gate.resume("c", "m", phase="before")
    gate.admit()
    gate.answered_one()
    gate.session_over()
    assert gate.restart_due() is False


def test_gate_failure_stops_admission():
    gate = Gate(threshold=5, n_sessions=2)
    gate.resume("c", "m", phase="before")
    gate.fail("boom")
    gate.fail("later failure")
    assert gate.error == "boom"
    assert gate.restart_due() is False
    with pytest.raises(Exception, match="boom"):
        gate.admit()


def _row(system, means, error=None, rate=10.0, rss=2**20):
    kinds = {k: {"turns": 2, "ttft_ms": {"mean": m, "p50": m, "p95": m}, "floor_ms_mean": 10.0,
                 "ttft_over_floor": m / 10.0, "cached_tokens": None, "timings_cache_n": None,
                 "prompt_tokens": 100, "identical": 1.0} for k, m in means.items()}
    return {"system": system, "error": error, "restarted": True, "turns": 2 * len(kinds), "identical": 1.0,
            "kinds": kinds, "decode": {"tokens": 100, "busy_s": 100 / rate if rate else 0.0, "tokens_per_s": rate,
                                       "answers": 2, "answers_without_usage": 0},
            "peak_rss_bytes": [rss, rss], "peak_rss_max_bytes": rss, "idle_wait_p95_s": None,
            "idle_wait_buckets": []}


def test_ratios_take_fixed_peers_per_kind():
    """Later and after-restart turns over llama-server -np's; first turns over -np -fa off's (the
    same numerics), even where another llama-server setting is faster."""
    rows = [_row("edgesync-slots", {"first": 300.0, "later": 50.0, "after-restart": 40.0}, rate=30.0, rss=3 * 2**20),
            _row("llama-server", {"first": 1.0, "later": 1.0, "after-restart": 1.0}, rate=99.0),  # never a peer
            _row("llama-server-np", {"first": 100.0, "later": 200.0, "after-restart": 400.0}, rate=20.0),
            _row("llama-server-np-fa-off", {"first": 150.0, "later": 2.0, "after-restart": 2.0}, rate=15.0),
            _row("edgesync-no-idle", {"first": 1.0}, error="did not start")]
    r = ratios(rows)
    assert r["ttft"]["first"]["peer"] == "llama-server-np-fa-off"
    assert r["ttft"]["first"]["edgesync-slots"] == pytest.approx(2.0)
    assert r["ttft"]["later"]["peer"] == "llama-server-np"
    assert r["ttft"]["later"]["edgesync-slots"] == pytest.approx(0.25)
    assert r["ttft"]["after-restart"]["edgesync-slots"] == pytest.approx(0.1)
    assert r["decode_tokens_per_s"]["peer"] == "llama-server-np"
    assert r["decode_tokens_per_s"]["edgesync-slots"] == pytest.approx(1.5)
    assert r["peak_rss"]["edgesync-slots"] == pytest.approx(3.0)
    assert "edgesync-no-idle" not in r["ttft"]["first"]
    text = report(rows)
    assert ("| later turns | edgesync-slots | llama-server | llama-server-np | llama-server-np-fa-off |") in text
    assert "| mean TTFT / llama-server-np-fa-off's | 2.00x |" in text
    assert "| mean TTFT / llama-server-np's | 0.25x |" in text
    assert ("edgesync-slots: mean TTFT, first turns 2.00x (llama-server-np-fa-off); later turns 0.25x "
            "(llama-server-np); after the restart 0.10x (llama-server-np); aggregate decode tok/s 1.50x and peak "
            "RSS 3.00x llama-server-np's") in text
    assert "| edgesync-slots | 6 | 100% | 30.0 (1.50x) | 100 / 3.3 |" in text
    assert "did not start" in text


def test_ratios_without_their_peers():
    rows = [_row("edgesync", {"first": 10.0, "later": 50.0}), _row("llama-server", {"first": 5.0, "later": 5.0})]
    assert ratios(rows) == {"ttft": {}}
    text = report(rows)
    assert "later turns n/a (llama-server-np did not run)" in text
    assert "first turns n/a (llama-server-np-fa-off did not run)" in text
    assert "| mean TTFT / llama-server-np-fa-off's (llama-server-np-fa-off did not run) | n/a | n/a |" in text


def test_a_peer_without_such_turns_is_told_from_one_that_did_not_run():
    rows = [_row("edgesync", {"first": 10.0, "later": 50.0}), _row("llama-server-np", {"first": 5.0})]
    text = report(rows)
    assert "later turns n/a (llama-server-np has none)" in text
    assert "| mean TTFT / llama-server-np's (llama-server-np has none) | n/a |" in text


def test_first_turns_without_the_fa_off_peer_get_no_ratio():
    """No fallback to llama-server -np (flash attention on) for first turns."""
    rows = [_row("edgesync", {"first": 10.0, "later": 50.0}), _row("llama-server-np", {"first": 5.0, "later": 25.0})]
    r = ratios(rows)
    assert "first" not in r["ttft"] and r["ttft"]["later"]["edgesync"] == pytest.approx(2.0)
