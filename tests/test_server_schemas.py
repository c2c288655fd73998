"""The request bodies of the OpenAI-compatible API (pure validation, no server): numbers and
flags are taken as JSON numbers and booleans only, so a client's string or bool in their place
is refused naming the field (the real server's 400 for the same bodies is in test_server.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from edgesync_engines.server.schemas import ChatCompletionRequest, CompletionRequest

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
