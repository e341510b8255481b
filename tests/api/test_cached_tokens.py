"""Cached prompt tokens in every dialect's usage, through the official clients: what a request reports equals the
prefix-cache hits the node counted for it (its `prefix_hits`), a repeated prompt reports its cached blocks, and a
prompt that shares no block with an earlier one reports 0."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import anthropic
import openai
import pytest

from exo_like.engines.work import BLOCK_SIZE
from tests.api_server import NodeProcess, checkpoint, node  # noqa: F401  (fixtures)
from tests.step_metrics import own_entry


def unique_text() -> str:
    """A prompt no earlier request began with (its first words are new), several KV blocks long."""
    return f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(6 * BLOCK_SIZE))


def asked(node: NodeProcess, request: Callable[[str], int], text: str) -> tuple[int, int]:  # noqa: F811
    """(cached tokens the request reported, prefix-cache hits the node counted for it)."""
    before = own_entry(node)["prefix_hits"]
    cached = request(text)
    return cached, own_entry(node)["prefix_hits"] - before


@pytest.fixture(scope="module")
def dialects(node: NodeProcess, checkpoint: Path) -> dict[str, Callable[[str], int]]:  # noqa: F811
    model = checkpoint.name
    client = openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=node.base_url, api_key="unused", max_retries=0, timeout=60)

    def chat(text: str) -> int:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                               max_tokens=2, temperature=0)
        return reply.usage.prompt_tokens_details.cached_tokens

    def completion(text: str) -> int:
        reply = client.completions.create(model=model, prompt=text, max_tokens=2, temperature=0)
        return reply.usage.prompt_tokens_details.cached_tokens

    def responses(text: str) -> int:
        reply = client.responses.create(model=model, input=text, max_output_tokens=2, temperature=0)
        return reply.usage.input_tokens_details.cached_tokens

    def messages(text: str) -> int:
        reply = claude.messages.create(model=model, max_tokens=2,
                                       messages=[{"role": "user", "content": text}])
        counted = claude.messages.count_tokens(model=model, messages=[{"role": "user", "content": text}])
        # As Anthropic counts: input_tokens are the prompt's tokens not read from the cache.
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens
        assert reply.usage.cache_creation_input_tokens == 0
        return reply.usage.cache_read_input_tokens

    def streamed_messages(text: str) -> int:
        with claude.messages.stream(model=model, max_tokens=2,
                                    messages=[{"role": "user", "content": text}]) as stream:
            final = stream.get_final_message()
        return final.usage.cache_read_input_tokens

    return {"chat": chat, "completions": completion, "responses": responses, "anthropic": messages,
            "anthropic streamed": streamed_messages}


@pytest.mark.parametrize("dialect", ["chat", "completions", "responses", "anthropic", "anthropic streamed"])
def test_cached_tokens_are_the_prefix_cache_hits_of_the_request(node: NodeProcess,  # noqa: F811
                                                                dialects: dict[str, Callable[[str], int]],
                                                                dialect: str) -> None:
    request = dialects[dialect]
    text = unique_text()
    first, first_hits = asked(node, request, text)
    again, again_hits = asked(node, request, text)
    assert (first, again) == (first_hits, again_hits)
    assert again >= 5 * BLOCK_SIZE and again % BLOCK_SIZE == 0, again  # the repeated prompt's whole blocks
    if dialect == "completions":  # no template before the text: a new prompt shares no block with any other
        assert first == 0
