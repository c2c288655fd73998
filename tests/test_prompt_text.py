"""Tests for edgesync_engines.request.prompt_text: which text of a request is embedded (the
last user turn of chat messages or of a rendered chat template, the tail of a raw prompt).

Data: ``system_prompts.json`` row 0 (the study app) as a long system prompt (conftest's
``study_prompt``). No model is loaded.
"""

from __future__ import annotations

import pytest

from edgesync_engines.request.prompt_text import TAIL_WORDS, embed_text_for


def test_embed_text_for_messages_picks_last_user_turn(study_prompt):
    messages = [
        {"role": "system", "content": study_prompt},
        {"role": "user", "content": "How can I improve my English Language?"},
        {"role": "assistant", "content": "Read every day."},
        {"role": "user", "content": "  How do I lose weight?  "},
        {"role": "assistant", "content": ""},
    ]
    assert embed_text_for(messages) == "How do I lose weight?"
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is HNSW?"}, {"type": "image_url"}]}]
    assert embed_text_for(parts) == "What is HNSW?"
    assert embed_text_for({"role": "user", "content": "one message"}) == "one message"
    # no user turn: the last non-system message
    assert embed_text_for([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]) == "A"
    with pytest.raises(TypeError):
        embed_text_for([("user", "tuple")])
    with pytest.raises(TypeError):
        embed_text_for(42)


def test_embed_text_for_raw_string_takes_the_tail(study_prompt):
    question = "How do I improve my English speaking?"
    prompt = study_prompt + "\n\n" + study_prompt + "\n\nQuestion: " + question
    words = prompt.split()
    assert len(words) > TAIL_WORDS
    tail = embed_text_for(prompt)
    assert tail.endswith(question)
    assert tail.split() == words[-len(tail.split()) :]  # whole words, from a word boundary
    assert len(tail.split()) <= TAIL_WORDS and len(tail) <= 1000
    assert embed_text_for("  short prompt\n") == "short prompt"
    assert embed_text_for("a b c d e", max_words=2) == "d e"
    # a single 5,000-character "word" (no spaces) is cut by characters
    assert len(embed_text_for("x" * 5000)) == 1000


def test_embed_text_for_rendered_chat_template(study_prompt):
    rendered = (
        f"<|im_start|>system\n{study_prompt}<|im_end|>\n"
        "<|im_start|>user\nHow do I lose weight?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert embed_text_for(rendered) == "How do I lose weight?"
