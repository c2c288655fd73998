"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests follow the OpenAI API: ``model``, ``max_tokens`` (or ``max_completion_tokens``),
``temperature`` (0 to 2), ``top_p`` (0 exclusive to 1), ``seed``, ``stop`` (a string or up to 4),
``n`` (1 only), ``stream`` and ``stream_options.include_usage``. Fields this server does not
use (``user``, ``presence_penalty``, ...) are accepted and ignored, as ordinary clients send
them. EdgeSync's own options go in the extension object ``edgesync`` (:class:`EdgeSyncOptions`),
which other servers ignore and ordinary clients never send.

Responses carry the OpenAI fields, ``usage.prompt_tokens_details.cached_tokens`` being the
prompt tokens whose KV was reused (the worker's live sequence, or injected from the store), plus
an ``edgesync`` object (:class:`EdgeSyncInfo`) that clients which do not know it ignore.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOPS = 4


class EdgeSyncOptions(BaseModel):
    """The ``edgesync`` extension field of a request. ``reuse``: ``exact`` (token-identical KV
    only: answers equal uncached ones) or ``semantic`` (also a similar prompt's KV: close, not
    always equal); None keeps the server's setting."""

    model_config = ConfigDict(extra="forbid")
    reuse: Literal["exact", "semantic"] | None = None


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = Field(False, strict=True)


class SamplingRequest(BaseModel):
    """What both completion endpoints take besides the prompt."""

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
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string (or a list holding one)."""

    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"exactly one prompt is supported, got {len(value)}")
        return value

    def text(self) -> str:
        """The prompt string."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens whose KV was reused (the worker's live sequence, or
    injected from the store)."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of one answer."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class EdgeSyncInfo(BaseModel):
    """The ``edgesync`` extension object of a response: the ``hit`` kind (exact, partial,
    miss), ``tokens_reused`` (= cached_tokens) and ``tokens_prefilled`` (tokens), the engine's
    ``ttft_ms`` (ms, from the engine taking the request to its first token), ``queue_ms`` (ms
    spent waiting for a worker), ``approximate`` (a similar prompt's KV served it),
    ``convertible`` (another engine's KV, converted), ``live_tokens`` (tokens of
    ``tokens_reused`` the worker's live conversation still held: nothing injected) and
    ``idle_wait_ms`` (ms the request waited for idle-time work, a batch or a job's start, to
    end; None when none ran)."""

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
