"""What text of a request the semantic lookup embeds (request-path policy, not storage): the
last user turn of chat messages or of a prompt rendered with a known chat template, else the
prompt's tail."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

TAIL_WORDS = 160
"""Words kept by :func:`embed_text_for` from the end of a long text: at 1.3-1.5 word pieces per
English word, 160 words fit MiniLM's 256 word pieces (``embedders.MAX_SEQ_TOKENS``)."""
TAIL_CHARS = 1000
"""Characters kept at most by :func:`embed_text_for`: a second cap for text with few spaces."""


def _content_text(content: Any) -> str:
    """Text of a chat message's content: a string, or OpenAI-style parts ``[{"type": "text",
    "text": ...}, ...]`` (non-text parts are skipped), or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    raise TypeError(f"message content: expected str or a list of parts, got {type(content).__name__}")


# The opening of a user turn in rendered chat templates, and the end of a turn: ChatML
# (SmolLM2, Qwen), Llama 3, Gemma, Phi-3/Zephyr, and Llama 2/Mistral's [INST] ... [/INST].
_USER_TURN = re.compile(
    r"<\|im_start\|>user\s*\n|<\|start_header_id\|>user<\|end_header_id\|>|<start_of_turn>user\s*\n|<\|user\|>|\[INST\]"
)
_TURN_END = re.compile(r"<\|im_end\|>|<\|eot_id\|>|<end_of_turn>|<\|end\|>|\[/INST\]")


def _last_user_turn_of_rendered(text: str) -> str | None:
    """The last user turn of a prompt rendered with a known chat template, or None."""
    last = None
    for last in _USER_TURN.finditer(text):  # noqa: B007 - keeps the last match; finditer has no reverse
        pass
    if last is None:
        return None
    turn = text[last.end() :]
    end = _TURN_END.search(turn)
    turn = turn[: end.start()] if end else turn
    return turn if turn.strip() else None


def _tail(text: str, max_words: int, max_chars: int) -> str:
    text = text.strip()
    words = text.split()
    if len(words) > max_words:
        text = " ".join(words[-max_words:])
    if len(text) > max_chars:
        cut = text[-max_chars:]
        space = cut.find(" ")
        # Start at a word boundary when there is one in the first half of the cut.
        if 0 <= space < max_chars // 2:
            cut = cut[space + 1 :]
        text = cut
    return text


def embed_text_for(
    prompt_or_messages: str | Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    max_words: int = TAIL_WORDS,
    max_chars: int = TAIL_CHARS,
) -> str:
    """The text to embed for a request: what tells it apart from others (MiniLM reads only the
    first 256 word pieces):

    * chat messages (mappings with ``role`` and ``content``: a string or OpenAI-style text
      parts): the last user turn; else the last non-system message with text; else all joined;
    * a string rendered with a known chat template (ChatML, Llama 3, Gemma, Phi-3/Zephyr,
      ``[INST]``): its last user turn;
    * any other string: its tail.

    The text is then cut to its last ``max_words`` words and ``max_chars`` characters, from a
    word boundary (words joined by single spaces); a short text is returned stripped.

    ``prompt_or_messages``: a prompt string, one message mapping, or a sequence of messages;
    ``max_words``, ``max_chars`` >= 1. Returns a string, empty for an empty prompt.

    Raises TypeError (not a string or message mappings), ValueError (a cap < 1).
    """
    if max_words < 1 or max_chars < 1:
        raise ValueError(f"max_words and max_chars must be >= 1, got {max_words}, {max_chars}")
    if isinstance(prompt_or_messages, str):
        turn = _last_user_turn_of_rendered(prompt_or_messages)
        return _tail(prompt_or_messages if turn is None else turn, max_words, max_chars)
    if isinstance(prompt_or_messages, Mapping):
        messages: list = [prompt_or_messages]
    elif isinstance(prompt_or_messages, Sequence) and not isinstance(prompt_or_messages, (bytes, bytearray)):
        messages = list(prompt_or_messages)
    else:
        raise TypeError(
            f"prompt_or_messages: expected str or chat messages, got {type(prompt_or_messages).__name__}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}]: expected a mapping with 'role' and 'content', got {type(m).__name__}")
    texts = [(str(m.get("role", "")), _content_text(m.get("content"))) for m in messages]
    for role, text in reversed(texts):
        if role == "user" and text.strip():
            return _tail(text, max_words, max_chars)
    for role, text in reversed(texts):
        if role != "system" and text.strip():
            return _tail(text, max_words, max_chars)
    return _tail("\n".join(text for _, text in texts), max_words, max_chars)
