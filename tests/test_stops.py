"""StopScanner: what streamed text may be sent before a stop sequence is ruled in or out."""

from __future__ import annotations

from edgesync_engines.request.stops import StopScanner


def _run(pieces, stops):
    s = StopScanner(stops)
    sent = [s.feed(p) for p in pieces]
    return sent, s.flush(), s.stopped


def test_a_stop_split_across_pieces_is_cut_and_never_sent():
    sent, tail, stopped = _run(["Hello wor", "ld. ", "END", " more"], ["ld. END"])
    assert "".join(sent) + tail == "Hello wor"
    assert sent == ["Hello wor", "", "", ""] and stopped


def test_a_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    sent, tail, stopped = _run(["abc#", "#x", "y"], ["###"])
    assert sent == ["abc", "##x", "y"] and tail == "" and not stopped


def test_held_text_at_the_end_is_flushed():
    sent, tail, stopped = _run(["one ST"], ["STOP"])
    assert sent == ["one "] and tail == "ST" and not stopped


def test_the_earliest_of_several_stops_wins_and_no_stop_passes_everything():
    sent, tail, stopped = _run(["a.b!c"], ["!", "."])
    assert sent == ["a"] and stopped
    assert _run(["x", "y"], []) == (["x", "y"], "", False)
