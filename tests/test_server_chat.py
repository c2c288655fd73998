"""``edgesync serve`` as a chat backend (the real server, one worker, the real SmolLM2, idle-time
storing on as the server's default): a second turn continues the worker's live conversation and
answers as an uncached run does; a stop sequence ends decoding at the token that completes it; a
client that goes away (from a stream or from a whole answer) frees the worker and leaves its prompt
stored; a request naming another
model is answered by the served one; a server stopped right after an answer stores the
conversation before it exits, unless a second signal skips that. Figures come from the server's
own answers and ``/metrics``, never from timing."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import openai
import pytest

from edgesync_bench.workloads import seed_workload
from tests.serve_process import ServeProcess

pytestmark = [pytest.mark.model, pytest.mark.server]

TURN_TOKENS = 24
WAIT_S = 120.0
"""How long a poll of ``/metrics`` may go on before the test fails (a hang, not a measurement)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"EDGESYNC_IDLE_STORE": ""}  # blank: the server's default
    # one slot: what the worker's one live sequence holds is what these tests follow
    with ServeProcess(tmp_path_factory.mktemp("chat-store"), "--workers", "1", "--slots", "1", env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _metric(server, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _await_metric(server, name: str, above: float) -> float:
    """Poll ``name`` until it exceeds ``above``; returns it (fails after :data:`WAIT_S`)."""
    deadline = time.monotonic() + WAIT_S
    while (value := _metric(server, name)) <= above:
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        time.sleep(0.1)
    return value


def test_a_second_turn_continues_the_live_conversation(server, client, model, reference):
    # first in the module: the idle-time work seen below is this conversation's
    assert "idle-time storing on" in server.stderr()
    first = seed_workload(1)[0].as_messages()
    turn1 = client.chat.completions.create(model=model, messages=first, max_tokens=TURN_TOKENS)
    answer = turn1.choices[0].message.content
    history = [*first, {"role": "assistant", "content": answer}]
    # the worker prefills the conversation with its answer between requests and reports it
    _await_metric(server, "edgesync_idle_tokens_prefilled_total", 0)
    live_before = _metric(server, "edgesync_live_prefix_requests_total")

    second = [*history, {"role": "user", "content": "Can you say that again in one short sentence?"}]
    turn2 = client.chat.completions.create(model=model, messages=second, max_tokens=TURN_TOKENS)
    history_tokens = len(reference.prompt_tokens(history, add_generation_prompt=False))
    assert turn2.usage.prompt_tokens_details.cached_tokens >= history_tokens - 16
    assert turn2.choices[0].message.content == reference.generate(second, max_tokens=TURN_TOKENS).text
    assert _metric(server, "edgesync_live_prefix_requests_total") == live_before + 1  # nothing injected
    assert turn2.model_extra["edgesync"]["live_tokens"] == turn2.usage.prompt_tokens_details.cached_tokens


def test_a_stop_sequence_ends_decoding(client, model, reference):
    messages = seed_workload(2)[1].as_messages()
    max_tokens = 64
    full = reference.generate(messages, max_tokens=max_tokens)
    stop = next(w for w in full.text.split()[3:] if len(w) >= 4 and w.isalpha())  # a word a few tokens in
    # decoding ends at the token whose text completes the stop sequence
    def text(k: int) -> str:
        return b"".join(reference.adapter.token_bytes(t) for t in full.tokens[:k]).decode("utf-8", "ignore")

    upto = next(k for k in range(1, len(full.tokens) + 1) if stop in text(k))
    stopped = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stop=[stop])
    assert stopped.choices[0].message.content == full.text[:full.text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == upto
    assert upto < len(full.tokens) and upto <= max_tokens // 4


STORY = [{"role": "system", "content": (
    "You are Mara, the keeper of the lighthouse on Skerry Point. You tell long stories about the storms, the ships "
    "and the gulls of the northern coast, in plain words, with many details about the lamp, the fog horn and the "
    "logbook you have kept for forty years.")},
    {"role": "user", "content": "Tell me the longest story you know."}]
"""A prompt whose answer runs long: what a client gives up on in the tests below."""
LONG_ANSWER = 400
"""Answer tokens (under one 512-token idle batch) whose idle-time job lasts over a second on one
core: a request or signal sent as the answer arrives still finds it running, on a loaded machine
too (96 tokens took 0.4-0.8 s, which a busy test process could miss)."""


def test_a_client_that_goes_away_frees_the_worker_and_its_prompt_is_stored(server, client, model):
    story = STORY
    cancelled = _metric(server, "edgesync_cancelled_requests_total")
    completion = _metric(server, "edgesync_completion_tokens_total")
    stream = client.chat.completions.create(model=model, messages=story, max_tokens=1000, stream=True)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    stream.response.close()
    assert _await_metric(server, "edgesync_cancelled_requests_total", cancelled) == cancelled + 1
    assert _metric(server, "edgesync_completion_tokens_total") == completion  # it was not answered to the end

    # (a) the worker serves the next request
    other = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=4)
    assert other.choices[0].finish_reason in ("stop", "length") and other.usage.completion_tokens >= 1
    # (b) the abandoned prompt was stored: the store serves it (not the live sequence, which holds
    # the other conversation now)
    live = _metric(server, "edgesync_live_prefix_requests_total")
    again = client.chat.completions.create(model=model, messages=story, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.model_extra["edgesync"]["hit"] in ("exact", "partial")
    assert _metric(server, "edgesync_live_prefix_requests_total") == live


def test_a_client_that_stops_waiting_for_a_whole_answer_frees_the_worker(server, client, model):
    """A non-streamed request whose client times out (the connection closes) is cancelled: the
    worker stops decoding instead of answering nobody to ``max_tokens``."""
    cancelled = _metric(server, "edgesync_cancelled_requests_total")
    completion = _metric(server, "edgesync_completion_tokens_total")
    impatient = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=2.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=model, messages=[*STORY[:1], {"role": "user", "content": (
            "Tell me the longest story you know, about the winter of the great storm.")}], max_tokens=1000)
    assert _await_metric(server, "edgesync_cancelled_requests_total", cancelled) == cancelled + 1
    assert _metric(server, "edgesync_completion_tokens_total") == completion  # it was not answered to the end
    after = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=4)
    assert after.usage.completion_tokens >= 1


def test_every_request_whose_client_left_is_cancelled_a_queued_one_too(server, client, model):
    """Two whole answers on the one worker, the second queued behind the first, and both clients
    time out: both jobs are cancelled, the queued one before it starts, and nothing is decoded
    for them. Before, a worker honoured only the last cancel written to it: the first job ran on
    to ``max_tokens`` for nobody, and the next request waited for it."""
    cancelled = _metric(server, "edgesync_cancelled_requests_total")
    completion = _metric(server, "edgesync_completion_tokens_total")
    story = [*STORY[:1], {"role": "user", "content": "Tell me the longest story you know, about a lighthouse."}]
    timed_out: list[Exception] = []

    def ask(timeout_s: float) -> None:
        impatient = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=timeout_s)
        try:
            impatient.chat.completions.create(model=model, messages=story, max_tokens=1000)
        except openai.APITimeoutError as exc:
            timed_out.append(exc)

    # the queued request's client leaves first, then the running one's
    askers = [threading.Thread(target=ask, args=(timeout_s,), daemon=True) for timeout_s in (6.0, 2.0)]
    for n, asker in enumerate(askers, start=1):
        asker.start()
        _await_metric(server, "edgesync_queued_requests", n - 0.5)
    for asker in askers:
        asker.join(WAIT_S)
    assert len(timed_out) == 2
    assert _await_metric(server, "edgesync_cancelled_requests_total", cancelled + 1.5) == cancelled + 2
    after = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=4)
    assert _metric(server, "edgesync_completion_tokens_total") == completion + after.usage.completion_tokens


def test_a_model_the_server_does_not_serve_is_answered_by_the_one_it_serves(client, model):
    assert model != "gpt-4o-mini"
    chat = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=4)
    assert chat.model == model and chat.choices[0].message.content
    text = client.completions.create(model="text-davinci-003", prompt="Once upon a time", max_tokens=4)
    assert text.model == model and text.usage.completion_tokens >= 1


def test_a_stop_right_after_an_answer_still_stores_the_conversation(tmp_path, reference):
    """SIGTERM as soon as the answer arrives: the worker finishes the idle-time job it had just
    begun (the answer's tokens, at least one batch) before it closes the store, so the next
    start serves the whole history from the store."""
    store, max_tokens = tmp_path / "store", 96
    with ServeProcess(store, "--workers", "1", env={"EDGESYNC_IDLE_STORE": "1"}) as first_server:
        c = openai.OpenAI(base_url=first_server.base_url, api_key="unused", max_retries=0, timeout=120)
        turn1 = c.chat.completions.create(model="any", messages=STORY, max_tokens=max_tokens)
        assert first_server.stop() == 0  # at once: the job has one or more 64-token batches to go
        assert turn1.usage.completion_tokens == max_tokens
        assert "idle-time work not finished" not in first_server.stderr()
    history = [*STORY, {"role": "assistant", "content": turn1.choices[0].message.content}]
    second = [*history, {"role": "user", "content": "Now a short one, please."}]
    with ServeProcess(store, "--workers", "1") as restarted:
        c = openai.OpenAI(base_url=restarted.base_url, api_key="unused", max_retries=0, timeout=120)
        turn2 = c.chat.completions.create(model="any", messages=second, max_tokens=8)
    history_tokens = len(reference.prompt_tokens(history, add_generation_prompt=False))
    # what the injection rule leaves to recompute: the history's last partial row group
    assert turn2.usage.prompt_tokens_details.cached_tokens >= history_tokens - 16
    assert turn2.choices[0].message.content == reference.generate(second, max_tokens=8).text


def test_a_second_signal_skips_storing_and_the_store_stays_usable(tmp_path, reference):
    store = tmp_path / "store"
    with ServeProcess(store, "--workers", "1", env={"EDGESYNC_IDLE_STORE": "1"}) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        turn1 = c.chat.completions.create(model="any", messages=STORY, max_tokens=LONG_ANSWER)
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT_S
        while "storing the conversations just answered" not in s.stderr():
            assert time.monotonic() < deadline and s.proc.poll() is None, s.stderr()
            time.sleep(0.02)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(WAIT_S) == 0
        assert "idle-time work skipped" in s.stderr()
    second = [*STORY, {"role": "assistant", "content": turn1.choices[0].message.content},
              {"role": "user", "content": "Now a short one, please."}]
    with ServeProcess(store, "--workers", "1") as restarted:
        c = openai.OpenAI(base_url=restarted.base_url, api_key="unused", max_retries=0, timeout=120)
        turn2 = c.chat.completions.create(model="any", messages=second, max_tokens=8)
    assert turn2.choices[0].message.content == reference.generate(second, max_tokens=8).text


def test_a_forced_stop_answers_the_requests_in_flight_503_without_a_traceback(tmp_path):
    """A second Ctrl-C (uvicorn's forced exit, which cancels the requests' tasks) while a stream
    runs and a whole answer waits behind it: the stream ends with the ``shutting_down`` error
    event and ``[DONE]``, the whole answer is a 503 in the OpenAI shape, and the log holds no
    traceback."""
    with ServeProcess(tmp_path / "store", "--workers", "1", "--grace-seconds", "60") as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        errors = []

        def whole():
            try:
                c.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            except openai.APIStatusError as exc:
                errors.append(exc)

        stream = c.chat.completions.create(model="any", messages=STORY, max_tokens=2000, stream=True)
        next(iter(stream))  # the worker decodes it
        waiting = threading.Thread(target=whole)
        waiting.start()
        deadline = time.monotonic() + WAIT_S
        while _metric(s, "edgesync_queued_requests") < 2:  # the whole answer reached the pool
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGINT)
        while _accepts(s):  # the first signal is taken once the listening socket closes
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError) as ended:
            for _ in stream:
                pass
        waiting.join(WAIT_S)
        assert s.proc.wait(WAIT_S) is not None
    assert "shutting down" in str(ended.value)
    assert len(errors) == 1 and errors[0].status_code == 503 and errors[0].body["code"] == "shutting_down"
    assert "Traceback" not in s.stderr() and "Exception in ASGI" not in s.stderr(), s.stderr()


def _accepts(s: ServeProcess) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{s.port}/health", timeout=5).close()
    except OSError:
        return False
    return True


def test_a_request_that_waits_for_an_idle_batch_says_how_long(tmp_path):
    """One idle-time batch for the whole job (``EDGESYNC_IDLE_BATCH`` 512): a request sent as
    soon as the answer arrives waits in the worker's queue for the job's start or that batch,
    and the answer and ``/metrics`` report the wait (at most the request's whole queueing)."""
    env = {"EDGESYNC_IDLE_STORE": "1", "EDGESYNC_IDLE_BATCH": "512"}
    with ServeProcess(tmp_path / "store", "--workers", "1", "--slots", "1", env=env) as s:  # one sequence
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        c.chat.completions.create(model="any", messages=STORY, max_tokens=LONG_ANSWER)
        other = c.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=2)
        info = other.model_extra["edgesync"]
        assert info["idle_wait_ms"] is not None and 0 < info["idle_wait_ms"] <= info["queue_ms"] + 1
        assert _metric(s, "edgesync_idle_wait_seconds_count") == 1
