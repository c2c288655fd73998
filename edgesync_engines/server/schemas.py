"""Request and response bodies of the OpenAI-compatible API (pydantic models). A field at its "off"
value, or that does not change the answer, is ignored; one asking for what this server does not do is
refused naming it (docs/serving.md, Errors). ``usage.prompt_tokens_details.cached_tokens`` counts the
prompt tokens whose KV was reused.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from edgesync_engines.config import MAX_SEED

MAX_STOPS = 4


def _unsupported(why: str, off: str) -> ValueError:
    """The error for an unsupported field; ``off`` says what to send instead."""

    return ValueError(f"not supported by this server ({why}); omit it or send {off}")


def _json(value) -> str:
    """``value`` as JSON, cut short, to show in an error."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


class EdgeSyncOptions(BaseModel):
    """The ``edgesync`` extension field of a request. ``reuse``: ``exact`` (token-identical KV only)
    or ``semantic`` (also a similar prompt's KV); None keeps the server's setting."""

    model_config = ConfigDict(extra="forbid")
    reuse: Literal["exact", "semantic"] | None = None


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = Field(False, strict=True)


class SamplingRequest(BaseModel):
    """What both completion endpoints take besides the prompt. Refused (400 naming the field):
    tools or functions, ``response_format`` other than text, non-zero penalties, a non-empty
    ``logit_bias``, a ``seed`` outside 0..:data:`MAX_SEED`; the same fields at their off value pass."""

    model_config = ConfigDict(extra="ignore")
    model: str
    # strict: a string, a bool or a float where a number or a flag belongs is the client's
    # mistake, refused with its field named (as OpenAI does), not coerced
    max_tokens: int | None = Field(None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0, le=2, strict=True, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, strict=True, allow_inf_nan=False)
    seed: int | None = Field(None, strict=True)
    stop: str | list[str] | None = None
    n: int | None = Field(1, strict=True)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    edgesync: EdgeSyncOptions | None = None
    # OpenAI fields this server does not do: taken at their "off" value only (validators below);
    # loosely typed so that a wrong type is a 400 naming the field too
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    presence_penalty: float | None = Field(None, strict=True, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, strict=True, allow_inf_nan=False)
    logit_bias: dict | None = None

    @field_validator("seed")
    @classmethod
    def _seed_means_itself(cls, value: int | None) -> int | None:
        """A seed llama.cpp would reduce modulo 2**32, or take as "random" (:data:`MAX_SEED`)."""
        if value is not None and not 0 <= value <= MAX_SEED:
            raise ValueError(f"must be an int in 0..{MAX_SEED}, got {value}")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        if value:
            raise _unsupported("no tool calling", "[]")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_forced_call(cls, value: str | dict | None) -> str | dict | None:
        """A "required" or named function would demand a tool call, which never comes."""
        if value is not None and value not in ("none", "auto"):
            raise _unsupported("no tool calling", f'"none" or "auto", got {_json(value)}')
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict | None) -> dict | None:
        """``json_object`` or ``json_schema`` would need decoding constrained to JSON."""
        if value is not None and value.get("type") != "text":
            raise _unsupported("plain text only, no JSON mode or schema",
                               f'{{"type": "text"}}, got type {_json(value.get("type"))}')
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise _unsupported("no presence or frequency penalty", f"0, got {value:g}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise _unsupported("no logit bias", "{}")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"only n=1 is supported, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(value)}")
        return value

    def stops(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def wanted_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else None (the server's default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TextPart(BaseModel):
    """A text part of a message's content (``{"type": "text", "text": ...}``)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; a content given as parts is joined (text parts only)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def plain(self) -> dict:
        """``{"role", "content"}`` with the content as one string (``developer`` is sent as
        ``system``, as OpenAI treats it)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``. Refused besides :class:`SamplingRequest`'s:
    ``logprobs: true`` and ``top_logprobs`` > 0 (no log probabilities are computed)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, strict=True)

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("no log probabilities", "false")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise _unsupported("no log probabilities", f"0, got {value}")
        return value


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string (or a list holding one). Also refused:
    ``logprobs``, ``echo: true``, ``best_of`` > 1, a non-empty ``suffix``."""

    prompt: str | list[str]
    # an int in OpenAI's API; false is taken as "off" too, as some clients send it
    logprobs: StrictBool | StrictInt | None = None
    echo: bool | None = Field(None, strict=True)
    best_of: int | None = Field(None, ge=1, strict=True)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"exactly one prompt is supported, got {len(value)}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value:  # true, or an int other than 0
            raise _unsupported("no log probabilities", f"0, got {_json(value)}")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("the prompt is not echoed", "false")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, value: int | None) -> int | None:
        """More candidates than the one answer would be decoded for nothing (``n`` is 1 only)."""
        if value is not None and value > 1:
            raise _unsupported("one candidate per prompt", f"1, got {value}")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("no insertion: the prompt is only continued", '""')
        return value

    def text(self) -> str:
        """The prompt string."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens whose KV was reused (the worker's live sequence, or injected from the store)."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of one answer."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class EdgeSyncInfo(BaseModel):
    """The ``edgesync`` object of a response: ``hit`` (exact, partial, miss), ``tokens_reused``
    (= cached_tokens), ``tokens_prefilled``, ``ttft_ms`` (engine's, ms), ``queue_ms`` (waiting for a
    worker, ms), ``approximate``, ``convertible`` (another engine's KV), ``live_tokens`` (of
    ``tokens_reused``, held live: nothing injected), ``idle_wait_ms`` (ms waited for idle-time work;
    None when none ran)."""

    hit: str
    tokens_reused: int
    tokens_prefilled: int
    ttft_ms: float
    queue_ms: float
    approximate: bool
    convertible: bool
    similarity: float | None = None
    uncached_reason: str | None = None
    live_tokens: int = 0
    idle_wait_ms: float | None = None


class ChatMessageOut(BaseModel):
    """The assistant message of a choice."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """The one choice of a chat completion."""

    index: int = 0
    message: ChatMessageOut
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    edgesync: EdgeSyncInfo


class ChatDelta(BaseModel):
    """The delta of a streamed chat chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    """A choice of a streamed chat chunk."""

    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; the chunk with the
    ``finish_reason`` carries ``edgesync``, the optional last one ``usage`` (no choices)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    edgesync: EdgeSyncInfo | None = None


class CompletionChoice(BaseModel):
    """The one choice of a (streamed or not) text completion."""

    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(BaseModel):
    """A text completion, or one streamed chunk of one (the same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    edgesync: EdgeSyncInfo | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "edgesync"


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
