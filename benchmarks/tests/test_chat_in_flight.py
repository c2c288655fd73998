"""benchmarks/chat.py's new figures, pure parts: the union of decode intervals, the aggregate
decode rate, ``--in-flight`` as a comma list and the results keyed by it, the random-weight
detection, the ``edgesync-slots`` command line, and a streamed answer's times and usage read by
``stream_answer`` from a stand-in client. No model, no server, no timing asserted."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgesync_bench.chat import (
    RANDOM_WEIGHTS_NOTE,
    Plan,
    Reference,
    answer_tokens,
    check_chat_template,
    chosen_systems,
    decode_figures,
    gauge_value,
    in_flight_values,
    json_results,
    peer_ratios,
    random_weight_reason,
    report_all,
    server_for,
    stream_answer,
    summarize,
    union_seconds,
)


@pytest.mark.parametrize("intervals, covered", [
    ([], 0.0),
    ([(0.0, 2.0)], 2.0),
    ([(0.0, 2.0), (3.0, 4.0)], 3.0),  # a gap (a think time, the restart) is not counted
    ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # overlap counted once
    ([(1.0, 3.0), (0.0, 2.0)], 3.0),  # order does not matter
    ([(0.0, 10.0), (2.0, 3.0), (4.0, 5.0)], 10.0),  # nested
    ([(0.0, 1.0), (1.0, 2.0)], 2.0),  # touching
    ([(5.0, 5.0), (0.0, 1.0)], 1.0),  # a one-chunk answer: no length
])
def test_union_seconds(intervals, covered):
    assert union_seconds(intervals) == pytest.approx(covered)


def _rec(first, last, tokens):
    return {"first_s": first, "last_s": last, "completion_tokens": tokens}


def test_decode_figures_sum_tokens_after_the_first_over_the_busy_union():
    recs = [_rec(0.0, 2.0, 21), _rec(1.0, 3.0, 11), _rec(10.0, 11.0, 6)]
    d = decode_figures(recs)
    assert d["tokens"] == 20 + 10 + 5
    assert d["busy_s"] == pytest.approx(3.0 + 1.0)
    assert d["tokens_per_s"] == pytest.approx(35 / 4.0)
    assert d["answers"] == 3 and d["answers_without_usage"] == 0


def test_decode_figures_leave_out_answers_without_content():
    recs = [_rec(0.0, 2.0, 21),
            _rec(None, None, 7),  # no content chunk
            _rec(3.0, 3.0, 1)]  # one token: nothing after the first
    d = decode_figures(recs)
    assert d["tokens"] == 20 and d["busy_s"] == pytest.approx(2.0)
    assert d["answers"] == 2 and d["answers_without_usage"] == 0
    assert decode_figures([])["tokens_per_s"] is None
    assert decode_figures([_rec(1.0, 1.0, 1)])["tokens_per_s"] is None


def test_answers_without_usage_count_their_content_chunks():
    recs = [_rec(0.0, 2.0, 21), {**_rec(4.0, 5.0, None), "content_chunks": 11},
            {**_rec(6.0, 9.0, None), "content_chunks": 0}]  # neither: left out, interval too
    d = decode_figures(recs)
    assert d["tokens"] == 20 + 10 and d["busy_s"] == pytest.approx(3.0)
    assert d["answers"] == 2 and d["answers_without_usage"] == 2


def test_a_counted_stop_token_is_taken_off():
    """llama-server counts the end-of-generation token, after the last content chunk."""
    stopped = {**_rec(0.0, 1.0, 11), "finish_reason": "stop"}
    cut = {**_rec(2.0, 3.0, 11), "finish_reason": "length"}
    assert answer_tokens(stopped, counts_stop=True) == 10 and answer_tokens(stopped) == 11
    assert answer_tokens(cut, counts_stop=True) == 11
    assert decode_figures([stopped, cut], counts_stop=True)["tokens"] == 9 + 10
    assert decode_figures([stopped, cut])["tokens"] == 10 + 10


def test_summaries_take_the_stop_token_off_llama_servers_only():
    recs = [{**_rec(0.0, 1.0, 11), "finish_reason": "stop", "identical": True, "kind": "first", "ttft_ms": 5.0,
             "cached_tokens": None, "prompt_tokens": 3}]
    run = {"records": recs, "halves": [], "restarted": False, "error": None}
    assert summarize("llama-server-np", run)["decode"]["tokens"] == 9
    assert summarize("llama-server-np-fa-off", run)["decode"]["tokens"] == 9
    assert summarize("edgesync-slots", run)["decode"]["tokens"] == 10


def test_in_flight_values():
    assert in_flight_values("1,2,4") == (1, 2, 4)
    assert in_flight_values("2") == (2,)
    assert in_flight_values("4, 2,4") == (4, 2)
    for bad in ("0", "1,x", "", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            in_flight_values(bad)


def _row(system, later, rate):
    return {"system": system, "error": None, "restarted": True, "turns": 2, "identical": 1.0,
            "kinds": {"later": {"turns": 2, "ttft_ms": {"mean": later, "p50": later, "p95": later},
                                "floor_ms_mean": None, "ttft_over_floor": None, "cached_tokens": None,
                                "timings_cache_n": None, "prompt_tokens": 10, "identical": 1.0}},
            "decode": {"tokens": 10, "busy_s": 1.0, "tokens_per_s": rate, "answers": 2, "answers_without_usage": 0},
            "peak_rss_bytes": [2**20], "peak_rss_max_bytes": 2**20, "idle_wait_p95_s": None,
            "idle_wait_buckets": []}


def test_results_keyed_by_sessions_in_flight():
    results = {1: [_row("edgesync-slots", 100.0, 10.0), _row("llama-server-np", 100.0, 10.0)],
               4: [_row("edgesync-slots", 50.0, 40.0), _row("llama-server-np", 100.0, 20.0)]}
    out = json_results(results, {1: {"edgesync-slots": {"records": []}}})
    assert list(out) == ["1", "4"]
    assert out["4"]["ratios"]["decode_tokens_per_s"]["edgesync-slots"] == pytest.approx(2.0)
    assert out["1"]["ratios"]["decode_tokens_per_s"]["edgesync-slots"] == pytest.approx(1.0)
    assert out["4"]["ratios"]["ttft"]["later"]["edgesync-slots"] == pytest.approx(0.5)
    assert out["1"]["runs"] == {"edgesync-slots": {"records": []}} and out["4"]["runs"] == {}
    text = report_all(results)
    assert text.index("## 1 in flight") < text.index("## 4 in flight")
    four = text[text.index("## 4 in flight"):]
    assert "| edgesync-slots | 2 | 100% | 40.0 (2.00x) |" in four
    assert "| edgesync-slots | 2 | 100% | 10.0 (1.00x) |" in text[:text.index("## 4 in flight")]
    assert "random weights" not in text


def test_random_weights_note_above_every_table_set():
    results = {1: [_row("edgesync", 1.0, 1.0)], 2: [_row("edgesync", 1.0, 1.0)]}
    note = RANDOM_WEIGHTS_NOTE.format(name="shaped")
    text = report_all(results, note)
    assert text.count(note) == 4  # above each number's tables and above its headline
    assert text.startswith(f"## 1 in flight\n\n{note}")


def test_peer_ratios_need_the_peer_and_a_value():
    rows = [_row("a", 10.0, None), _row("llama-server-np", 20.0, 5.0)]
    assert peer_ratios(rows, "llama-server-np", lambda r: r["decode"]["tokens_per_s"]) == {
        "peer": "llama-server-np", "llama-server-np": 1.0}
    assert peer_ratios(rows, "absent", lambda r: 1.0) is None
    rows[1]["error"] = "did not start"
    assert peer_ratios(rows, "llama-server-np", lambda r: 1.0) is None


@pytest.mark.parametrize("metadata, path, random", [
    ({"general.name": "Smollm2 135M"}, "/m/SmolLM2.gguf", False),
    ({"general.name": "Llama 3.2 1B shape, random weights"}, "/m/x.gguf", True),
    ({"general.description": "Random init"}, "/m/x.gguf", True),
    ({"edgesync.random_weights": True}, "/m/x.gguf", True),
    ({"edgesync.random_weights": False}, "/m/x.gguf", False),
    ({"general.name": "Hf"}, "/root/.cache/edgesync/shaped-gguf/llama-1b-q4_k_m.gguf", True),
    ({"general.name": "Hf"}, "/root/.cache/edgesync/tiny-gguf/llama3-2ffaf.gguf", True),
    ({"general.name": "Hf"}, "/root/shaped-gguf-notes/x.gguf", False),
])
def test_random_weight_reason(metadata, path, random):
    assert (random_weight_reason(metadata, Path(path)) is not None) is random


def _args(**kw):
    base = {"systems": "edgesync,edgesync-slots,llama-server-np", "llama_server": Path("/nonexistent/llama-server"),
            "sessions": 8, "threads": 2, "n_ctx": 2048, "max_tokens": 16, "flash_attn": False}
    return SimpleNamespace(**{**base, **kw})


def test_chosen_systems_skip_slots_without_the_flag_and_llama_server_without_the_binary():
    said = []
    assert chosen_systems(_args(), said.append, has_slots=lambda: False) == ["edgesync"]
    assert any("edgesync-slots: skipped" in s for s in said)
    assert chosen_systems(_args(), said.append, has_slots=lambda: True) == ["edgesync", "edgesync-slots"]
    with pytest.raises(SystemExit, match="unknown edgesync-slot"):
        chosen_systems(_args(systems="edgesync-slot"), said.append, has_slots=lambda: True)


def test_slots_and_np_follow_the_sessions_in_flight(tmp_path):
    plan = Plan(_args(llama_server=Path("llama-server")), Path("m.gguf"), None, 1, tmp_path, None, in_flight=4)
    slots = server_for("edgesync-slots", plan, tmp_path)
    cmd = slots.command
    assert cmd[cmd.index("--workers") + 1] == "1" and cmd[cmd.index("--slots") + 1] == "4"
    assert slots.env["EDGESYNC_IDLE_STORE"] == "1" and slots.env["EDGESYNC_N_CTX"] == "2048"
    assert slots.env["EDGESYNC_THREADS"] == "2"
    assert "--slots" not in server_for("edgesync", plan, tmp_path).command  # a serve without --slots
    plan.serve_slots = True  # its default is then several slots a worker: the others get one
    for system in ("edgesync", "edgesync-no-idle", "edgesync-workers"):
        cmd = server_for(system, plan, tmp_path).command
        assert cmd[cmd.index("--slots") + 1] == "1"
    cmd = server_for("edgesync-workers", plan, tmp_path).command
    assert cmd[cmd.index("--workers") + 1] == "4"
    cmd = server_for("edgesync-slots", plan, tmp_path).command
    assert cmd.count("--slots") == 1 and cmd[cmd.index("--slots") + 1] == "4"
    np_cmd = server_for("llama-server-np", plan, tmp_path).command
    assert np_cmd[np_cmd.index("-np") + 1] == "4" and np_cmd[np_cmd.index("-c") + 1] == str(4 * 2048)
    off = server_for("llama-server-np-fa-off", plan, tmp_path).command
    assert off[off.index("-np") + 1] == "4" and off[-2:] == ["-fa", "off"]
    plan.in_flight = 16  # never more slots than sessions
    cmd = server_for("edgesync-slots", plan, tmp_path).command
    assert cmd[cmd.index("--slots") + 1] == "8"


def _chunk(content=None, finish=None, usage=None, role=False):
    choices = [] if content is None and finish is None and not role else [
        SimpleNamespace(delta=SimpleNamespace(content=content), finish_reason=finish)]
    return SimpleNamespace(choices=choices, usage=usage, model_extra={})


class _Client:
    def __init__(self, chunks):
        self.chunks, self.kwargs = chunks, None
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **kwargs):
        self.kwargs = kwargs
        return iter(self.chunks)


def test_stream_answer_times_first_and_last_content_chunks():
    usage = SimpleNamespace(completion_tokens=3, prompt_tokens_details=SimpleNamespace(cached_tokens=5))
    client = _Client([_chunk(role=True, content=""), _chunk("a"), _chunk("b"), _chunk("c"), _chunk(finish="stop"),
                      _chunk(usage=usage)])
    ticks = iter([10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5])  # sent, then one per chunk, then the end
    r = stream_answer(client, "m", [{"role": "user", "content": "hi"}], max_tokens=8, clock=lambda: next(ticks))
    assert client.kwargs["stream_options"] == {"include_usage": True} and client.kwargs["max_tokens"] == 8
    assert (r["sent_s"], r["first_s"], r["last_s"], r["end_s"]) == (10.0, 11.0, 12.0, 13.5)
    assert r["ttft_ms"] == pytest.approx(1000.0)
    assert r["text"] == "abc" and r["content_chunks"] == 3 and r["completion_tokens"] == 3
    assert r["finish_reason"] == "stop" and r["cached_tokens"] == 5


def test_stream_answer_without_content_or_usage():
    ticks = iter([0.0, 1.0, 2.0])
    r = stream_answer(_Client([_chunk(finish="length")]), "m", [], max_tokens=1, clock=lambda: next(ticks))
    assert r["first_s"] is None and r["last_s"] is None and r["completion_tokens"] is None
    assert r["ttft_ms"] == pytest.approx(2000.0)


def test_a_gguf_without_a_chat_template():
    """``llama`` has no llama.cpp built-in template: EdgeSync could not render a chat, the run
    stops; an architecture with one (``gemma3``) runs, with a warning."""
    said = []
    facts = {"path": "m.gguf", "chat_template": False, "architecture": "llama"}
    with pytest.raises(SystemExit, match="no tokenizer.chat_template"):
        check_chat_template(facts, said.append)
    check_chat_template({**facts, "architecture": "gemma3"}, said.append)
    assert len(said) == 1 and "built-in 'gemma'" in said[0]
    check_chat_template({**facts, "chat_template": True}, said.append)
    assert len(said) == 1


def test_the_reference_loads_the_servers_gguf(monkeypatch):
    """The uncached reference (token counts, fresh answers, floors) runs on ``--model``, not on
    EdgeSync's configured model."""
    import edgesync_engines.request.router as router

    seen = {}

    class FakeEdgeSync:
        def __init__(self, store, config):
            seen["model_path"], seen["n_ctx"] = config.model_path, config.n_ctx
            self.adapter = SimpleNamespace()

    monkeypatch.setattr(router, "EdgeSync", FakeEdgeSync)
    Reference(2, 512, 8, model=Path("/models/shaped.gguf"))
    assert seen == {"model_path": Path("/models/shaped.gguf"), "n_ctx": 512}


def test_gauge_value():
    text = "# TYPE edgesync_slots gauge\nedgesync_slots 4.0\nedgesync_slots_total 9\nx{a=\"1\"} 2\n"
    assert gauge_value(text, "edgesync_slots") == 4.0
    assert gauge_value(text, "x") is None and gauge_value("", "edgesync_slots") is None
