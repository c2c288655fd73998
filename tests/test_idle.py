"""Idle-time storing and stops on the real model (``request/idle.py``, ``EdgeSync.prepare``,
``generate(stop=...)``, ``GenerationStream.stop``): the next chat turn prefills only its new
message, answers equal an uncached run's, a request waits for one idle batch at most, and a
stopped answer still stores its prompt. Tokens evaluated are llama.cpp's own counts.

Sessions come from ../shared/workloads/chat_sessions.jsonl (real user turns).
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from edgesync_engines.adapters.kv_layout import MIN_FIRST_BATCH
from edgesync_engines.config import EdgeSyncConfig
from edgesync_engines.request.router import EdgeSync
from edgesync_store.schema import common_prefix_len
from tests.fake_adapter import FakeAdapter

pytestmark = [pytest.mark.model]

IDLE = EdgeSyncConfig.load({"idle_store": True})


@pytest.fixture(scope="module")
def sessions(data_dir):
    rows = [json.loads(line) for line in (data_dir / "chat_sessions.jsonl").read_text().splitlines()]
    return [r["turns"] for r in rows if len(r["turns"]) >= 3 and all(len(t) < 600 for t in r["turns"][:3])]


def prefilled(adapter, n_generated: int) -> int:
    """Prompt tokens llama.cpp evaluated since ``reset_perf`` (``n_p_eval`` counts multi-token
    batches and reports 0 as 1; ``n_eval`` counts one-token evaluations, which include every
    generated token but the last)."""
    perf = adapter.perf_counts()
    return (perf["n_p_eval"] if perf["n_p_eval"] > 1 else 0) + perf["n_eval"] - (n_generated - 1)


def expected_prefill(es: EdgeSync, history: list[dict], messages: list[dict]) -> int:
    """The most a turn may prefill once ``history`` is stored: its new tokens (after the
    history and the user turn's opening), plus what the injection rule recomputes before them
    (the prepared tokens' last ones up to the row group)."""
    held = len(es.history_tokens(history))
    n = len(es.prompt_tokens(messages))
    return n - es.adapter.usable_prefix(held - held % row_group(es), n)


def row_group(es: EdgeSync) -> int:
    """The row group of the engine's injection rule (probed at load: 1 on SmolLM2 here)."""
    return es.adapter.injection_rule.row_group


def idle_until_done(es: EdgeSync) -> None:
    assert es.idle.wait_idle(120), "idle-time work did not finish"


def first_turn_stored(es: EdgeSync, question: str, max_tokens: int) -> list[dict]:
    """Answer ``question`` with idle-time storing on and wait for its history to be stored;
    returns the conversation so far (question and answer)."""
    messages = [{"role": "user", "content": question}]
    messages.append({"role": "assistant", "content": es.generate(messages, max_tokens=max_tokens).text})
    idle_until_done(es)
    return messages


@pytest.mark.parametrize("which", [0, 1])
def test_next_turn_prefills_only_its_new_message(adapter, tmp_path, sessions, which):
    turns, asked = sessions[which], []
    with EdgeSync(adapter, store=tmp_path / "s", config=IDLE) as es:
        messages: list[dict] = []
        for k, user in enumerate(turns[:3]):
            messages.append({"role": "user", "content": user})
            result = es.generate(messages, max_tokens=48)
            if k:
                assert result.tokens_prefilled <= expected_prefill(es, messages[:-1], messages)
                assert result.live_tokens == result.tokens_reused > 0  # continued, nothing injected
            asked.append((list(messages), result.tokens))
            messages.append({"role": "assistant", "content": result.text})
            idle_until_done(es)
        assert es.idle.stats.jobs == 3 and es.idle.stats.tokens_wasted == 0
    uncached = EdgeSync(adapter, store=False)
    for prompt, tokens in asked:
        assert uncached.generate(prompt, max_tokens=48).tokens == tokens


def test_the_next_user_turns_opening_is_prepared_with_the_history(adapter, tmp_path, sessions):
    """The prepared tokens run past the answer's end into the next user turn's opening, as the
    next request renders it; that turn continues them and prefills only the rest."""
    with EdgeSync(adapter, store=tmp_path / "s", config=IDLE) as es:
        history = [{"role": "user", "content": sessions[0][0]},
                   {"role": "assistant", "content": sessions[0][0][::-1]}]
        plain = es.prompt_tokens(history, add_generation_prompt=False)
        ahead = es.history_tokens(history)
        messages = history + [{"role": "user", "content": sessions[0][1]}]
        tokens = es.prompt_tokens(messages)
        assert ahead[:len(plain)] == plain and len(ahead) > len(plain)
        assert tokens[:len(ahead)] == ahead
        done = es.prepare(history)
        assert done.tokens_ready == len(ahead) - len(ahead) % row_group(es)
        adapter.reset_perf()
        result = es.generate(messages, max_tokens=16)
        assert result.live_tokens == es.adapter.usable_prefix(done.tokens_ready, len(tokens))
        assert prefilled(adapter, len(result.tokens)) == len(tokens) - result.live_tokens
    assert result.tokens == EdgeSync(adapter, store=False).generate(messages, max_tokens=16).tokens


def test_a_conversation_another_engine_answered_is_prepared_later(adapter, tmp_path, sessions):
    """``prepare_later`` (what a server worker does with a conversation handed over by another)
    queues the history as idle-time work; once it ran, the next turn continues the live sequence
    and prefills only what follows the prepared tokens."""
    history = [{"role": "user", "content": sessions[1][0] + "\n\n" + sessions[0][0]},
               {"role": "assistant", "content": sessions[1][1] + " " + sessions[0][1]}]
    messages = [*history, {"role": "user", "content": sessions[1][2]}]
    with EdgeSync(adapter, store=tmp_path / "s", config=IDLE) as es:
        es.prepare_later(history)
        idle_until_done(es)
        assert es.idle.stats.jobs == 1 and es.idle.stats.fragments_written >= 1
        tokens = es.prompt_tokens(messages)
        ready = len(es.history_tokens(history)) // row_group(es) * row_group(es)
        adapter.reset_perf()
        result = es.generate(messages, max_tokens=16)
        assert result.live_tokens == es.adapter.usable_prefix(ready, len(tokens)) > 0
        assert prefilled(adapter, len(result.tokens)) == len(tokens) - result.live_tokens
    assert result.tokens == EdgeSync(adapter, store=False).generate(messages, max_tokens=16).tokens


@pytest.mark.parametrize("bad, says", [
    ("What is a KV cache?", "must be a list of dicts, got str"),
    (None, "got NoneType"),
    ([], "no chat messages"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"role": "user"}], r"messages\[0\] must be a dict with string 'role' and 'content'"),
    ([{"role": "user", "content": "  "}], "every chat message is empty"),
])
def test_prepare_later_refuses_what_is_not_chat_messages_at_once(bad, says):
    """Checked when called (a FAKE engine: nothing is evaluated), not on the idle thread."""
    es = EdgeSync(FakeAdapter(), store=False)
    with pytest.raises(ValueError, match=says):
        es.prepare_later(bad)
    assert not es.idle.has_work


def test_history_tokens_fall_back_to_the_history_alone(adapter):
    """A conversation that ends with a user message (the next request answers it) gets no user
    turn after it, and a template that refuses one (a FAKE engine, since the real model's
    template accepts any order) gives the history without a generation prompt."""
    es = EdgeSync(adapter, store=False)
    asked = [{"role": "user", "content": "What is a KV cache?"}]
    assert es.history_tokens(asked) == es.prompt_tokens(asked, add_generation_prompt=False)

    class Strict(FakeAdapter):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            if messages[-1]["role"] == "user" and len(messages) > 1:
                raise ValueError("Conversation roles must alternate")
            return super().apply_chat_template(messages, add_generation_prompt)

    strict = EdgeSync(Strict(), store=False)
    system = [{"role": "system", "content": "Answer briefly."}]
    assert strict.history_tokens(system) == strict.prompt_tokens(system, add_generation_prompt=False)
    fake = EdgeSync(FakeAdapter(), store=False)
    assert fake.history_tokens(system) == [ord(c) for c in "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                                                         "<|im_start|>user\n"]


def test_prepared_history_counted_by_llama_cpp(adapter, tmp_path, sessions):
    """The same with ``prepare`` in the foreground, so that llama.cpp's own counters hold the
    next turn's evaluations alone."""
    turns = sessions[1]
    messages = [{"role": "user", "content": turns[0]}]
    with EdgeSync(adapter, store=tmp_path / "s") as es:
        messages.append({"role": "assistant", "content": es.generate(messages, max_tokens=96).text})
        done = es.prepare(messages)
        assert done.tokens_reused > 0 and done.tokens_prefilled > 0
        history = list(messages)
        messages.append({"role": "user", "content": turns[1]})
        adapter.reset_perf()
        result = es.generate(messages, max_tokens=32)
        assert prefilled(adapter, len(result.tokens)) <= expected_prefill(es, history, messages)
    assert result.tokens == EdgeSync(adapter, store=False).generate(messages, max_tokens=32).tokens


def test_next_turn_after_a_restart_comes_from_the_store(adapter, tmp_path, sessions):
    turns = sessions[2]
    with EdgeSync(adapter, store=tmp_path / "s", config=IDLE) as es:
        messages = first_turn_stored(es, turns[0], 96)
        assert es.idle.stats.fragments_written >= 1
    adapter.clear_kv_cache()  # nothing live: a new process
    history = list(messages)
    messages.append({"role": "user", "content": turns[1]})
    with EdgeSync(adapter, store=tmp_path / "s") as es:
        adapter.reset_perf()
        result = es.generate(messages, max_tokens=48)
        assert result.live_tokens == 0 and result.tokens_reused > 0
        assert prefilled(adapter, len(result.tokens)) <= expected_prefill(es, history, messages)
    assert result.tokens == EdgeSync(adapter, store=False).generate(messages, max_tokens=48).tokens


def test_a_reference_run_on_the_same_engine_is_never_taken_for_live_kv(adapter, tmp_path, sessions):
    """Another EdgeSync that decodes on the same adapter leaves decoded KV under the same
    token IDs: the adapter's kv_epoch tells, and the next turn injects from the store."""
    turns = sessions[3]
    uncached = EdgeSync(adapter, store=False)
    with EdgeSync(adapter, store=tmp_path / "s", config=IDLE) as es:
        messages = first_turn_stored(es, turns[0], 64)
        messages.append({"role": "user", "content": turns[1]})
        reference = uncached.generate(messages, max_tokens=32)
        result = es.generate(messages, max_tokens=32)
        assert result.live_tokens == 0 and result.tokens == reference.tokens


def test_idle_kv_is_bit_identical_to_an_uncached_prefill(adapter, tmp_path, sessions):
    """The fragments idle work stored equal those cut from a clean prefill of the next turn."""
    turns = sessions[4]
    with EdgeSync(adapter, store=tmp_path / "s", config=IDLE) as es:
        messages = first_turn_stored(es, turns[0], 128)
        job_written = es.idle.stats.fragments_written
        tokens = es.prompt_tokens(messages + [{"role": "user", "content": turns[1]}])
        walked = es.store.prefix_walk(es.namespace, tokens)
        complete = [s for s in walked.spans if s.complete and len(s.keys) == 1]
        spans = [(s.token_start, s.token_end) for s in complete]
        fragments = [es.store.get(s.keys[0], copy=True) for s in complete]
    assert job_written >= 1 and spans and walked.matched_tokens >= len(tokens) - 64
    adapter.clear_kv_cache()
    adapter.prefill(tokens)
    fresh = adapter.extract_fragments(tokens, spans)
    got = {(f.token_start, f.token_end): f for f in fragments}
    for ref in fresh:
        frag = got[(ref.token_start, ref.token_end)]
        assert np.array_equal(np.asarray(frag.keys), np.asarray(ref.keys))
        assert np.array_equal(np.asarray(frag.values), np.asarray(ref.values))


def test_a_request_during_idle_work_waits_one_batch_at_most(adapter, tmp_path, system_prompts):
    config = EdgeSyncConfig.load({"idle_store": True, "idle_batch_tokens": MIN_FIRST_BATCH})
    messages = [{"role": "user", "content": "Write a very long story about a lighthouse keeper and a storm."}]
    with EdgeSync(adapter, store=tmp_path / "s", config=config) as es:
        answer = es.generate(messages, max_tokens=160)
        assert len(answer.tokens) > 8 * MIN_FIRST_BATCH
        deadline = time.monotonic() + 60
        while es.idle.progress() < MIN_FIRST_BATCH and time.monotonic() < deadline:
            time.sleep(0.001)
        other = es.generate([{"role": "system", "content": system_prompts[1]},
                             {"role": "user", "content": "Hi"}], max_tokens=2)
        assert other.idle_wait_ms is not None  # it did arrive during idle work
        # the batch in flight when the request came is all that ran before it was served
        assert 0 <= other.idle_wait_tokens < MIN_FIRST_BATCH + MIN_FIRST_BATCH
        idle_until_done(es)  # the runner counts the pause once it holds the lock again
        assert es.idle.stats.interrupted == 1


def test_a_request_stops_the_idle_batch_running_midway(adapter, tmp_path):
    """One idle-time batch for the whole conversation (``idle_batch_tokens`` 512): a request sent
    as soon as the answer is back finds that batch running, and llama.cpp's abort callback
    stops it, so no idle-time token was evaluated before the request was served (without the
    abort: the whole batch). The live sequence stays sound and known: the request continues
    the chat template's opening it shares with the conversation, its answer equals an uncached
    one, and the job, queued again, stores the whole conversation afterwards."""
    config = EdgeSyncConfig.load({"idle_store": True, "idle_batch_tokens": 512})
    messages = [{"role": "user", "content": "Write a very long story about a lighthouse keeper and a storm."}]
    question = [{"role": "user", "content": "Hi, who are you?"}]  # the same default system prompt
    with EdgeSync(adapter, store=False, config=EdgeSyncConfig.load({})) as uncached:
        expected = uncached.generate(question, max_tokens=8).tokens
    with EdgeSync(adapter, store=tmp_path / "s", config=config) as es:
        answered_at = time.time()
        answer = es.generate(messages, max_tokens=160)
        history = [*messages, {"role": "assistant", "content": answer.text}]
        deadline = time.monotonic() + 60
        while es.idle.work_ended_at < answered_at and time.monotonic() < deadline:
            time.sleep(0.001)  # the job has started: its one batch follows at once
        other = es.generate(question, max_tokens=8)
        assert other.idle_wait_ms is not None  # it did arrive during idle work
        assert other.idle_wait_tokens == 0
        shared = common_prefix_len(es.prompt_tokens(question), es.prompt_tokens(history))
        assert shared >= 8 and 0 < other.live_tokens <= shared
        assert other.tokens == expected
        idle_until_done(es)
        assert es.idle.stats.interrupted >= 1 and es.idle.stats.failed == 0
        nxt = [*history, {"role": "user", "content": "Shorter, please."}]
        adapter.clear_kv_cache()  # nothing live: the history comes from the store
        adapter.reset_perf()
        result = es.generate(nxt, max_tokens=8)
        assert prefilled(adapter, len(result.tokens)) <= expected_prefill(es, history, nxt)


def test_a_stop_string_ends_decoding(adapter, tmp_path):
    messages = [{"role": "user", "content": "Tell me about the history of the bicycle."}]
    with EdgeSync(adapter, store=tmp_path / "s") as es:
        whole = es.generate(messages, max_tokens=48)
        words = whole.text.split()
        assert len(words) > 8 and len(whole.tokens) == 48
        stop = " " + words[6]  # a word early in the answer
        needed = next(n for n in range(1, len(whole.tokens) + 1)
                      if stop in adapter.detokenize(whole.tokens[:n]))
        cut = es.generate(messages, max_tokens=48, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == whole.text[:whole.text.index(stop)]
    assert len(cut.tokens) == needed < len(whole.tokens)


def test_a_stopped_stream_frees_the_engine_and_stores_the_prompt(adapter, tmp_path, system_prompts):
    messages = [{"role": "system", "content": system_prompts[2]},
                {"role": "user", "content": "Explain how tides work, in great detail."}]
    with EdgeSync(adapter, store=tmp_path / "s") as es:
        stream = es.generate(messages, max_tokens=200, stream=True)
        next(stream), next(stream)
        result = stream.stop()
        assert result.finish_reason == "cancelled" and 2 <= len(result.tokens) < 200
        assert result.fragments_written >= 1
        again = es.generate(messages, max_tokens=4)
        assert again.hit == "exact" and again.tokens_prefilled == 1


def test_prepare_stores_a_system_prompt_before_any_request(adapter, tmp_path, system_prompts):
    system = [{"role": "system", "content": system_prompts[5]}]
    with EdgeSync(adapter, store=tmp_path / "s") as es:
        done = es.prepare(system)
        assert done.fragments_written >= 1 and done.tokens_prefilled == done.tokens_ready
        adapter.clear_kv_cache()  # as after a restart: only the store holds it
        messages = system + [{"role": "user", "content": "Where should I start?"}]
        result = es.generate(messages, max_tokens=16)
        assert result.tokens_reused >= done.tokens_ready - 2 * row_group(es)
    assert result.tokens == EdgeSync(adapter, store=False).generate(messages, max_tokens=16).tokens


def test_prepare_refuses_what_it_cannot_store(adapter):
    es = EdgeSync(adapter, store=False)
    with pytest.raises(ValueError, match="prepare: needs a store"):
        es.prepare("hello there")


def test_a_new_conversation_continues_the_shared_beginning_the_engine_holds(adapter, tmp_path, sessions):
    """Two first turns share only the chat template's beginning (its default system part, under
    the 64 tokens a fragment holds): the second continues that much of the live sequence,
    prefills the rest, and answers as an uncached run does."""
    with EdgeSync(adapter, store=tmp_path / "s", config=IDLE) as es:
        first_turn_stored(es, sessions[0][0], max_tokens=32)
        messages = [{"role": "user", "content": sessions[1][0]}]
        shared = common_prefix_len(es.prompt_tokens(messages), list(es.adapter.live_tokens()))
        adapter.reset_perf()
        result = es.generate(messages, max_tokens=32)
        assert 0 < result.live_tokens == result.tokens_reused <= shared < 64
        assert result.live_tokens == es.adapter.usable_prefix(int(shared), result.prompt_tokens)
        assert prefilled(adapter, len(result.tokens)) == result.prompt_tokens - result.live_tokens
    assert EdgeSync(adapter, store=False).generate(messages, max_tokens=32).tokens == result.tokens


def test_idle_work_run_by_its_owner_on_one_thread(adapter, tmp_path, sessions):
    """``threaded`` False (as a server worker runs it): no thread is started; ``run_pending``
    runs nothing while a request waits, then the whole job, and the next turn continues it."""
    turns = sessions[0]
    with EdgeSync(adapter, store=tmp_path / "s", config=IDLE) as es:
        es.idle.threaded = False
        threads = threading.active_count()
        messages = [{"role": "user", "content": turns[0]}]
        messages.append({"role": "assistant", "content": es.generate(messages, max_tokens=32).text})
        es.idle.busy = lambda: True  # a request waits
        assert not es.idle.run_pending()
        assert es.idle.stats.jobs == 0
        es.idle.busy = lambda: False
        assert es.idle.run_pending()
        assert es.idle.stats.jobs == 1 and es.idle.stats.tokens_prefilled > 0
        assert threading.active_count() == threads
        messages.append({"role": "user", "content": turns[1]})
        result = es.generate(messages, max_tokens=16)
        assert result.tokens_prefilled <= expected_prefill(es, messages[:-1], messages)
        assert result.live_tokens == result.tokens_reused > 0
    assert EdgeSync(adapter, store=False).generate(messages, max_tokens=16).tokens == result.tokens


def test_a_paused_job_resumes_before_an_older_conversations(adapter, tmp_path, sessions):
    """Two conversations answered on one engine (A, then B; ``threaded`` False, as a server
    worker runs them): B's history job starts first, and when the engine is wanted elsewhere
    after its first batch (``busy``, as for a server's other worker's prefill) it keeps its
    place. The next batch run is B's, continuing the live sequence where it stopped; sent to the
    queue's end, A's job ran next and replaced the live sequence with A's history."""
    small_batches = EdgeSyncConfig.load({"idle_store": True, "idle_batch_tokens": 16})
    with EdgeSync(adapter, store=tmp_path / "s", config=small_batches) as es:
        es.idle.threaded = False
        answered = []
        for turns in (sessions[0], sessions[1]):
            messages = [{"role": "user", "content": turns[0]}]
            messages.append({"role": "assistant", "content": es.generate(messages, max_tokens=64).text})
            answered.append(es.history_tokens(messages))
        history_b = answered[1]
        started = [0]  # wanted elsewhere once the next job started has run a batch
        es.idle.busy = lambda: es.idle.stats.jobs > started[0] and es.idle.progress() > 0
        assert not es.idle.run_pending()
        first = es.adapter.live_tokens()
        assert first == history_b[:len(first)] and es.idle.stats.interrupted == 1
        started[0] = es.idle.stats.jobs
        assert not es.idle.run_pending()
        second = es.adapter.live_tokens()
        assert len(second) > len(first) and second == history_b[:len(second)]
        assert es.idle.stats.interrupted == 2
        es.idle.busy = lambda: False
        assert es.idle.run_pending() and es.idle.stats.tokens_wasted == 0


def test_the_newest_conversation_is_live_again_after_an_older_ones_job(adapter, tmp_path, sessions):
    """Two conversations answered on one engine (A, then B) before any idle time: B's history
    job runs first. Before A's job replaces the live sequence, the engine makes room to inject
    B's history (asked here with a ``should_stop`` that stops any new work: True only when the
    room is already there). A's job runs; then B's runs once more, from the store, so that B's
    next turn continues the live sequence: it injects nothing and prefills only its new
    message (plus what the injection rule recomputes), and its answer is the uncached one."""
    with EdgeSync(adapter, store=tmp_path / "s", config=EdgeSyncConfig.load({"idle_store": True})) as es:
        es.idle.threaded = False
        histories = []
        for turns in (sessions[0], sessions[1]):
            messages = [{"role": "user", "content": turns[0]}]
            histories.append([*messages, {"role": "assistant", "content": es.generate(messages, max_tokens=64).text}])
        history_b = es.history_tokens(histories[1])
        es.idle.busy = lambda: es.idle.stats.jobs >= 2 and es.idle.progress() > 0  # A's job, one batch in
        assert not es.idle.run_pending() and es.idle.stats.jobs == 2
        assert es.adapter.make_room(len(history_b), lambda: True)
        es.idle.busy = lambda: False
        assert es.idle.run_pending()
        live = es.adapter.live_tokens()
        assert len(live) >= len(history_b) - row_group(es) and live == history_b[:len(live)]
        assert es.idle.stats.jobs == 4 and es.idle.stats.failed == 0  # B, A paused, A again, B again
        nxt = [*histories[1], {"role": "user", "content": sessions[1][1]}]
        result = es.generate(nxt, max_tokens=24)
        assert result.live_tokens == result.tokens_reused > 0
        assert result.tokens_prefilled <= expected_prefill(es, histories[1], nxt)
    with EdgeSync(adapter, store=False) as fresh:
        assert result.tokens == fresh.generate(nxt, max_tokens=24).tokens
