"""The request bodies of the OpenAI-compatible API (pure validation, no server): numbers and
flags are taken as JSON numbers and booleans only, so a client's string or bool in their place
is refused naming the field (the real server's 400 for the same bodies is in test_server.py);
fields asking for what the server does not do are refused naming them, unless at their "off"
value; seeds are those llama.cpp takes as themselves. The 400s are checked through the server's
handler of validation errors (``_validation_error``)."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from edgesync_engines.server.errors import _validation_error
from edgesync_engines.server.schemas import MAX_SEED, ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", "8"), ("max_tokens", True), ("max_tokens", 8.0), ("max_completion_tokens", "8"),
    ("temperature", "0"), ("temperature", True), ("top_p", "1"), ("seed", "7"), ("n", "1"),
    ("stream", "true"), ("stream", 1),
])
def test_a_string_or_bool_in_a_numeric_or_flag_field_is_refused_naming_it(field, value):
    for model, body in ((ChatCompletionRequest, {"messages": MESSAGES}), (CompletionRequest, {"prompt": "Hi"})):
        with pytest.raises(ValidationError) as exc:
            model(model="m", **body, **{field: value})
        assert exc.value.errors()[0]["loc"][0] == field


def test_json_numbers_and_booleans_are_taken_as_given():
    req = ChatCompletionRequest(model="m", messages=MESSAGES, max_tokens=8, temperature=0, top_p=1, seed=7, n=1,
                                stream=True, stream_options={"include_usage": True})
    assert (req.wanted_tokens(), req.temperature, req.top_p, req.seed, req.stream) == (8, 0.0, 1.0, 7, True)
    assert req.stream_options.include_usage is True
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest(model="m", messages=MESSAGES, stream_options={"include_usage": "yes"})
    assert exc.value.errors()[0]["loc"] == ("stream_options", "include_usage")


def _error(model, **fields):
    """The 400 the server answers for a body of ``model`` with ``fields``: pydantic's errors as
    FastAPI reports them (located under "body"), through the server's handler."""
    body = {"messages": MESSAGES} if model is ChatCompletionRequest else {"prompt": "Hi"}
    with pytest.raises(ValidationError) as exc:
        model(model="m", **body, **fields)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.value.errors()]
    return _validation_error(RequestValidationError(errors), "application/json")


BOTH = (ChatCompletionRequest, CompletionRequest)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
UNSUPPORTED = [
    *((m, "tools", [TOOL]) for m in BOTH),
    (ChatCompletionRequest, "tool_choice", "required"),
    (ChatCompletionRequest, "tool_choice", {"type": "function", "function": {"name": "get_weather"}}),
    (ChatCompletionRequest, "functions", [TOOL["function"]]),
    (ChatCompletionRequest, "function_call", {"name": "get_weather"}),
    *((ChatCompletionRequest, "response_format", {"type": t}) for t in ("json_object", "json_schema")),
    (ChatCompletionRequest, "logprobs", True), (ChatCompletionRequest, "top_logprobs", 3),
    *((m, f, v) for m in BOTH for f, v in (("presence_penalty", 0.5), ("frequency_penalty", -1),
                                            ("logit_bias", {"50256": -100}))),
    (CompletionRequest, "logprobs", 5), (CompletionRequest, "logprobs", True), (CompletionRequest, "echo", True),
    (CompletionRequest, "best_of", 3), (CompletionRequest, "suffix", "\n}"),
]


@pytest.mark.parametrize(("model", "field", "value"), UNSUPPORTED)
def test_a_field_asking_for_what_the_server_does_not_do_is_refused_naming_it(model, field, value):
    """Tool calling, JSON output, log probabilities, penalties, logit bias, best_of, echo and
    suffix: a 400 invalid_value naming the field and saying it is not supported, not an answer
    silently without it."""
    err = _error(model, **{field: value})
    assert (err.status, err.code, err.param) == (400, "invalid_value", field)
    assert err.message.startswith(f"{field}: not supported by this server (") and "omit it or send " in err.message
    assert "Value error" not in err.message


@pytest.mark.parametrize(("field", "value"), [
    ("tools", "get_weather"), ("tool_choice", 1), ("response_format", "json_object"),
    ("presence_penalty", "0"), ("presence_penalty", True), ("logit_bias", []), ("logprobs", "false"),
])
def test_a_wrong_type_in_an_unsupported_field_is_refused_naming_it(field, value):
    err = _error(ChatCompletionRequest, **{field: value})
    assert (err.status, err.code, err.param) == (400, "invalid_value", field)


OFF_VALUES = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "auto",
              "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0,
              "logit_bias": {}, "user": "u-1", "metadata": {"k": "v"}, "store": False,
              "parallel_tool_calls": True, "service_tier": "auto"}


def test_the_off_values_clients_always_send_and_harmless_fields_are_accepted():
    """What many clients send on every request (the unsupported fields at their "off" value,
    ``user``, ``metadata``, ...) changes nothing and is taken."""
    chat = ChatCompletionRequest(model="m", messages=MESSAGES, logprobs=False, top_logprobs=0, **OFF_VALUES)
    text = CompletionRequest(model="m", prompt="Hi", logprobs=0, echo=False, best_of=1, suffix="", **OFF_VALUES)
    assert (chat.logprobs, chat.tools, text.logprobs, text.best_of) == (False, [], 0, 1)
    for model, extra in ((ChatCompletionRequest, {"tool_choice": "auto"}), (CompletionRequest, {"logprobs": False}),
                         (CompletionRequest, {"logprobs": None, "echo": None, "suffix": None})):
        body = {"messages": MESSAGES} if model is ChatCompletionRequest else {"prompt": "Hi"}
        model(model="m", **body, **extra)


def test_a_validator_message_has_no_pydantic_prefix():
    """A validator's own message reaches the client as written, after the field's name."""
    err = _error(ChatCompletionRequest, stop=["a", "b", "c", "d", "e"])
    assert (err.param, err.message) == ("stop", "stop: at most 4 stop sequences, got 5")
    assert _error(CompletionRequest, n=2).message == "n: only n=1 is supported, got 2"


@pytest.mark.parametrize("seed", [-1, 2**32 - 1, 2**32, 2**33 + 7])
def test_a_seed_llama_cpp_would_change_is_refused(seed):
    """llama.cpp's seeds are uint32 (a larger one is reduced modulo 2**32) and 0xFFFFFFFF means
    "random": outside 0..2**32-2 a seed would not mean itself."""
    for model in BOTH:
        err = _error(model, seed=seed)
        assert (err.param, err.message) == ("seed", f"seed: must be an int in 0..{MAX_SEED}, got {seed}")


def test_the_seeds_at_both_ends_are_accepted():
    assert MAX_SEED == 2**32 - 2
    for seed in (0, 2**32 - 2):
        assert ChatCompletionRequest(model="m", messages=MESSAGES, seed=seed).seed == seed
        assert CompletionRequest(model="m", prompt="Hi", seed=seed).seed == seed
