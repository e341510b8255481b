"""How many tokens a request may generate: the prompt and the completion share the context; OpenAI's dialect refuses
a request for more than fits (400), Anthropic's and Ollama's get what fits (their clients ask for more than small
models hold)."""

from __future__ import annotations

import pytest

from exo_like.api.generation import resolve_max_tokens
from exo_like.errors import InvalidRequestError


def test_a_request_without_a_limit_gets_the_rest_of_the_context() -> None:
    assert resolve_max_tokens(100, None, 4096, "messages") == 3996


def test_more_than_fits_is_a_400_unless_it_is_a_cap() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        resolve_max_tokens(100, 32000, 4096, "messages")
    assert raised.value.param == "max_tokens" and raised.value.code == "context_length_exceeded"
    assert resolve_max_tokens(100, 32000, 4096, "messages", cap=True) == 3996
    assert resolve_max_tokens(100, 50, 4096, "messages", cap=True) == 50


def test_a_prompt_that_fills_the_context_is_refused_either_way() -> None:
    for cap in (False, True):
        with pytest.raises(InvalidRequestError) as raised:
            resolve_max_tokens(4096, 10, 4096, "messages", cap=cap)
        assert raised.value.param == "messages"
