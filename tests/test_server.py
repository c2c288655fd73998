"""``edgesync serve`` end to end: the real server (a subprocess on a free loopback port, a store in
a temp dir, the real SmolLM2) driven by the real ``openai`` client. Streamed and whole answers
equal the library's own uncached ``generate``; a repeat injects all but at most one prompt token
and says so in ``usage.prompt_tokens_details.cached_tokens``; the cache survives a restart; every
bad input gets its status and the OpenAI error shape; a killed worker is replaced."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from edgesync_bench.workloads import seed_workload
from tests.serve_process import ServeProcess

pytestmark = [pytest.mark.model, pytest.mark.server]

MAX_TOKENS = 24
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-store")


@pytest.fixture(scope="module")
def server(store):
    with ServeProcess(store, "--workers", "1", "--max-body-bytes", str(BODY_LIMIT), "--max-tokens-limit", "512") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


@pytest.fixture(scope="module")
def chat_messages():
    """A seed-workload request: a system prompt and a question (342 prompt tokens)."""
    return seed_workload(1)[0].as_messages()


def _streamed_chat(client, model, messages, **kw) -> tuple[str, object]:
    """The joined deltas of a streamed chat answer and its usage chunk."""
    parts, usage = [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
    return "".join(parts), usage


def _post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """A raw POST (for bodies the openai client would never send)."""
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _assert_error_shape(body: dict) -> dict:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_chat_whole_streamed_and_repeat(client, model, reference, chat_messages):
    expected = reference.generate(chat_messages, max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(model=model, messages=chat_messages, max_tokens=MAX_TOKENS)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == expected.prompt_tokens == len(reference.prompt_tokens(chat_messages))
    assert whole.usage.completion_tokens == MAX_TOKENS
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert whole.model_extra["edgesync"]["hit"] == "miss"

    text, usage = _streamed_chat(client, model, chat_messages, max_tokens=MAX_TOKENS)
    assert text == expected.text
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1

    again = client.chat.completions.create(model=model, messages=chat_messages, max_tokens=MAX_TOKENS,
                                           extra_body={"edgesync": {"reuse": "exact"}})
    assert again.choices[0].message.content == expected.text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= again.usage.prompt_tokens - 1
    ext = again.model_extra["edgesync"]
    assert ext["hit"] == "exact" and ext["tokens_reused"] == cached
    assert ext["approximate"] is False and ext["convertible"] is False
    assert ext["tokens_prefilled"] == again.usage.prompt_tokens - cached


def test_completions_whole_and_streamed(client, model, reference, chat_messages):
    prompt = chat_messages[0]["content"] + "\n\nQuestion: " + chat_messages[1]["content"] + "\nAnswer:"
    expected = reference.generate(prompt, max_tokens=MAX_TOKENS)
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS)
    assert whole.choices[0].text == expected.text
    assert whole.usage.prompt_tokens == expected.prompt_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, stream=True) if c.choices)
    assert streamed == expected.text
    repeat = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS)
    assert repeat.usage.prompt_tokens_details.cached_tokens >= repeat.usage.prompt_tokens - 1
    assert repeat.choices[0].text == expected.text


def test_stop_sequence_cuts_the_answer(client, model, reference, chat_messages):
    expected = reference.generate(chat_messages, max_tokens=MAX_TOKENS).text
    stop = expected.split()[3]
    whole = client.chat.completions.create(model=model, messages=chat_messages, max_tokens=MAX_TOKENS, stop=[stop])
    assert whole.choices[0].message.content == expected[:expected.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    text, _ = _streamed_chat(client, model, chat_messages, max_tokens=MAX_TOKENS, stop=stop)
    assert text == expected[:expected.index(stop)]


def _requests_total(server) -> dict[tuple[str, str], float]:
    """``edgesync_requests_total`` of ``/metrics`` by (endpoint, status)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
        lines = [line for line in r.read().decode().splitlines() if line.startswith("edgesync_requests_total{")]
    out = {}
    for line in lines:
        labels, value = line[len("edgesync_requests_total{"):].split("} ")
        fields = dict(part.split("=", 1) for part in labels.split(","))
        out[(fields["endpoint"].strip('"'), fields["status"].strip('"'))] = float(value)
    return out


def test_errors_have_the_openai_shape_and_status(server, client, model, reference, chat_messages):
    before = _requests_total(server)
    status, body = _post(server, "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400 and _assert_error_shape(body)["code"] == "invalid_json"

    long_text = "tell me more about the weather " * 700
    n_prompt = len(reference.prompt_tokens([{"role": "user", "content": long_text}]))
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as big:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_text}],
                                           max_tokens=100, stream=stream)
        err = _assert_error_shape(big.value.response.json())
        assert err["code"] == "context_length_exceeded"
        assert f"prompt of {n_prompt} tokens" in err["message"] and "context of 4096 tokens" in err["message"]

    for bad, param in (({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 2}, "n"),
                       ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 513}, "max_tokens"),
                       ({"max_tokens": "8"}, "max_tokens"), ({"temperature": "0"}, "temperature"),
                       ({"max_tokens": 4, "max_completion_tokens": 513}, "max_completion_tokens"),
                       ({"extra_body": {"stream": "yes"}}, "stream"),
                       ({"extra_body": {"stream_options": {"include_usage": "yes"}}}, "stream_options.include_usage"),
                       ({"extra_body": {"edgesync": {"documents": []}}}, "edgesync.documents"),
                       ({"extra_body": {"edgesync": {"reuse": "sloppy"}}}, "edgesync.reuse")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=model, messages=chat_messages, **bad)
        assert _assert_error_shape(exc.value.response.json())["param"] == param, bad

    status, body = _post(server, "/v1/chat/completions", json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "x" * BODY_LIMIT}]}).encode())
    assert status == 413 and _assert_error_shape(body)["code"] == "request_too_large"

    status, body = _post(server, "/v1/files", b"{}")
    assert status == 404 and _assert_error_shape(body)["type"] == "invalid_request_error"

    # every error above is counted, whichever layer answered it: the body's JSON and fields
    # (validation), the engine's refusal, the body limit (the request guard), an unknown path
    after = _requests_total(server)
    grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert grown == {("/v1/chat/completions", "400"): 15.0, ("/v1/chat/completions", "413"): 1.0,
                     ("other", "404"): 1.0}


def test_bodies_and_prompts_the_server_refuses_name_what_was_wrong(server, model):
    """A body that is not UTF-8, nests too deep or holds too long an integer for the JSON
    decoder, or is sent as another Content-Type, a prompt the engine
    refuses (empty, a lone surrogate in a message or a stop string), a text prompt over the
    context and a temperature that is not a finite number: each a 400 with its code, naming the
    field where there is one."""
    chat, text = "/v1/chat/completions", "/v1/completions"
    cases = [
        (chat, b'{"model": "x", "messages": [{"role": "user", "content": "\xff"}]}', "invalid_json", None),
        (chat, b"[" * 5000 + b"]" * 5000, "invalid_json", None),
        (text, json.dumps({"model": model, "prompt": "", "max_tokens": 4}).encode(), "invalid_value", "prompt"),
        (chat, b'{"model": "x", "messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 4}',
         "invalid_value", "messages"),
        (chat, b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "\\udfff"]}',
         "invalid_value", "stop"),
        (text, json.dumps({"model": model, "prompt": "weather " * 5000, "max_tokens": 4}).encode(),
         "context_length_exceeded", "prompt"),
        (chat, b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
         "invalid_value", "temperature"),
    ]
    for path, body, code, param in cases:
        status, answer = _post(server, path, body)
        err = _assert_error_shape(answer)
        assert (status, err["code"], err["param"]) == (400, code, param), (body[:80], err)
        assert "parsing the body" not in err["message"] and "codec" not in err["message"]
        assert err["message"].startswith(param or ""), err  # the body's own name for the field
    status, answer = _post(server, chat, b'{"model": "x", "messages": [], "seed": 1' + b"0" * 5000 + b"}")
    err = _assert_error_shape(answer)
    assert (status, err["code"]) == (400, "invalid_json") and "too many digits" in err["message"]
    status, answer = _post(server, chat, b'{"model": "x", "messages": [{"role": "user", "content": "hi"}]}',
                           headers={"Content-Type": "text/plain"})
    assert status == 400 and "Content-Type: application/json" in _assert_error_shape(answer)["message"]
    not_object = "must be a JSON object"
    for body, says in ((b"", "the body is empty"), (b"null", not_object), (b"[1]", not_object)):
        status, answer = _post(server, chat, body)
        err = _assert_error_shape(answer)
        assert (status, err["code"]) == (400, "invalid_json") and says in err["message"], (body, err)
        assert "Content-Type" not in err["message"]  # it was JSON already
    # a huge value or field name is not sent back whole
    head = b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], '
    for body, reason in ((head + b'"max_tokens": 1' + b"0" * 4000 + b"}", "limit"),
                         (head + b'"edgesync": {"' + b"A" * 20_000 + b'": 1}}', "not permitted")):
        status, answer = _post(server, chat, body)
        err = _assert_error_shape(answer)
        assert status == 400 and len(err["message"]) <= 300 and len(err["param"] or "") <= 300, err
        assert reason in err["message"], err  # the value is cut, not the reason after it
    status, answer = _post(server, text, json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2}).encode())
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1


def _metric(server, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_killed_worker_is_replaced(server, client, model, reference, chat_messages):
    old_pid = server.health()["worker_pids"][0]
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Write a long story."}],
                                            max_tokens=500, stream=True)
    next(iter(stream))  # the worker is generating
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(openai.APIError) as died:
        for _ in stream:
            pass
    assert "died" in str(died.value)
    deadline = time.monotonic() + 120
    while server.health()["worker_pids"][0] in (None, old_pid):
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.2)
    answer = client.chat.completions.create(model=model, messages=chat_messages, max_tokens=MAX_TOKENS)
    assert answer.choices[0].message.content == reference.generate(chat_messages, max_tokens=MAX_TOKENS).text
    assert answer.model_extra["edgesync"]["hit"] == "exact"  # the store is intact


def test_restart_keeps_the_cache_and_the_key_is_checked(server, store, reference, chat_messages, model):
    assert server.stop() == 0
    assert "store closed" in server.stderr()
    with ServeProcess(store, "--workers", "1", "--api-key", "s3cret") as s2:
        wrong = openai.OpenAI(base_url=s2.base_url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as denied:
            wrong.chat.completions.create(model=model, messages=chat_messages)
        assert _assert_error_shape(denied.value.response.json())["code"] == "invalid_api_key"
        assert s2.health()["status"] == "ok"  # liveness needs no key
        ok = openai.OpenAI(base_url=s2.base_url, api_key="s3cret", max_retries=0, timeout=120)
        first = ok.chat.completions.create(model=model, messages=chat_messages, max_tokens=MAX_TOKENS)
        assert first.model_extra["edgesync"]["hit"] == "exact"
        assert first.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
        assert first.choices[0].message.content == reference.generate(chat_messages, max_tokens=MAX_TOKENS).text
        req = urllib.request.Request(f"http://127.0.0.1:{s2.port}/metrics", headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(req, timeout=10) as r:
            metrics = r.read().decode()
        assert 'edgesync_hits_total{kind="exact"} 1.0' in metrics
        cached = float(first.usage.prompt_tokens_details.cached_tokens)
        assert f"edgesync_cached_prompt_tokens_total {cached}" in metrics
        assert "edgesync_ttft_seconds_count 1.0" in metrics
        assert s2.stop() == 0


def _queued(server) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("edgesync_queued_requests "):
                return float(line.split()[1])
    raise AssertionError("no edgesync_queued_requests")


@pytest.mark.parametrize("grace", ["0", "1"])
def test_a_stop_answers_what_outlasts_the_grace_with_503(tmp_path, grace):
    """SIGTERM while one worker streams a long answer and a whole answer waits behind it: once
    the grace is over, the stream's last event before ``[DONE]`` is the 503 ``shutting_down``
    error and the whole answer gets that status and error (before the fix: a stream cut without
    a last event, a bare 500, and a traceback in the log); the worker never starts the long
    prompt queued behind (every job is cancelled at once at the grace's end: before, the stream's
    stop let the worker start it before its own request had noticed, and prefill it to the end),
    so the server exits 0 without being killed, and logs no traceback."""
    long_prompt = "10, 11, 12, 13, 14, 15, " * 60  # 1,440 tokens: seconds of prefill
    # one slot: the whole answer waits in the worker's queue behind the stream
    with ServeProcess(tmp_path / "s", "--workers", "1", "--slots", "1", "--grace-seconds", grace,
                      "--log-level", "INFO") as s:
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = json.dumps({"model": "any", "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 2000,
                               "stream": True}).encode()
            req = urllib.request.Request(f"{s.base_url}/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        events.append(line[6:].decode().strip())
                        started.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert started.wait(120), s.stderr()
        whole: list[tuple[int, dict]] = []
        waiting = threading.Thread(target=lambda: whole.append(_post(s, "/v1/completions", json.dumps(
            {"model": "any", "prompt": long_prompt, "max_tokens": 2000}).encode())), daemon=True)
        waiting.start()
        deadline = time.monotonic() + 60
        while _queued(s) < 2:  # both in the worker's queue before the signal
            assert time.monotonic() < deadline, s.stderr()
            time.sleep(0.05)
        assert s.stop() == 0
        reader.join(60)
        waiting.join(60)
    assert events[-1] == "[DONE]" and len(events) > 3
    assert _assert_error_shape(json.loads(events[-2]))["code"] == "shutting_down"
    status, body = whole[0]
    assert status == 503 and _assert_error_shape(body)["code"] == "shutting_down"
    assert "Traceback" not in s.stderr() and "Exception in ASGI application" not in s.stderr()
    assert "did not stop" not in s.stderr()
    served = [int(n) for n in re.findall(r"request: (\d+) prompt tokens", s.stderr())]
    assert served and max(served) < 100  # the stream's prompt only


def test_a_server_with_the_cache_off_says_so_and_stores_nothing(tmp_path, chat_messages):
    """``EDGESYNC_CACHE=0``: the banner says the cache is off (it said "store ..., idle-time
    storing on"), the store directory is never made, and an answer asked twice reuses no token."""
    store = tmp_path / "s"
    with ServeProcess(store, "--workers", "1", env={"EDGESYNC_CACHE": "0"}) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        answers = [client.chat.completions.create(model=model, messages=chat_messages, max_tokens=4, temperature=0)
                   for _ in range(2)]
        banner = s.stderr()
    assert "cache off (EDGESYNC_CACHE=0)" in banner and "idle-time storing" not in banner
    assert not store.exists()
    assert [a.usage.prompt_tokens_details.cached_tokens or 0 for a in answers] == [0, 0]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
