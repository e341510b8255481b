"""Concurrent requests on one node: no cross-talk, fair interleaving, and cancellation that frees the cache."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from pathlib import Path

import openai
import pytest

from tests.api_server import NodeProcess, checkpoint, node, wait_for  # noqa: F401  (fixtures)

LONG_PROMPT = " ".join(f"line {i}: the fox jumps over café {i}" for i in range(120))  # > 512 tokens: chunked
REQUESTS = [
    ("Hello!", {"temperature": 0}),
    ("What is the capital of France?", {"temperature": 1.2, "seed": 11}),
    (LONG_PROMPT, {"temperature": 0}),
    ("café ±×÷", {"temperature": 0.8, "top_p": 0.9, "seed": 5}),
    ("Numbers: 1 2 3", {"temperature": 1.0, "top_k": 20, "seed": 99}),
]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def model_id(checkpoint: Path) -> str:  # noqa: F811
    return checkpoint.name


@pytest.fixture(scope="module")
def client(node: NodeProcess) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def split_sampling(params: dict) -> tuple[dict, dict]:  # type: ignore[type-arg]
    """top_k is not in the OpenAI signature: it travels in extra_body."""
    extra = {k: v for k, v in params.items() if k == "top_k"}
    return {k: v for k, v in params.items() if k != "top_k"}, extra


def test_concurrent_streams_equal_the_same_requests_alone(node: NodeProcess, client: openai.OpenAI,  # noqa: F811
                                                          model_id: str) -> None:
    alone = []
    for prompt, params in REQUESTS:
        kwargs, extra = split_sampling(params)
        response = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=MAX_TOKENS, extra_body=extra, **kwargs)
        alone.append(response.choices[0].message.content)

    async def one(async_client: openai.AsyncOpenAI, prompt: str,  # type: ignore[type-arg]
                  params: dict) -> tuple[str, float, float]:
        kwargs, extra = split_sampling(params)
        stream = await async_client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, stream=True,
            extra_body=extra, **kwargs)
        pieces, first, last = [], 0.0, 0.0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic()
                last = time.monotonic()
                pieces.append(chunk.choices[0].delta.content)
        return "".join(pieces), first, last

    async def all_at_once() -> list[tuple[str, float, float]]:
        async with openai.AsyncOpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as async_client:
            return await asyncio.gather(*(one(async_client, p, params) for p, params in REQUESTS))

    together = asyncio.run(all_at_once())
    assert [text for text, _, _ in together] == alone
    # They really ran interleaved: some stream produced text before another one had finished.
    assert any(a[1] < b[2] and b[1] < a[2] for a in together for b in together if a is not b)
    health = node.get_json("/health")
    assert (health["in_flight_requests"], health["active_kv_caches"]) == (0, 0)


def test_short_request_is_not_queued_behind_a_long_one(node: NodeProcess, client: openai.OpenAI,  # noqa: F811
                                                       model_id: str) -> None:
    long_stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Tell me everything."}], max_tokens=3000,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(long_stream))
        short = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, temperature=0)
        assert short.usage.completion_tokens == 5
        # The long request is still generating: the short one was interleaved, not queued behind it.
        requests = node.get_json("/v1/debug/requests")["requests"]
        assert len(requests) == 1 and requests[0]["generated_tokens"] < 3000
    finally:
        long_stream.close()
    assert wait_for(lambda: node.get_json("/health")["active_kv_caches"] == 0)


def _generated_total(node: NodeProcess) -> int:  # noqa: F811
    return node.get_json("/health")["tokens_generated_total"]


def _idle(node: NodeProcess) -> bool:  # noqa: F811
    health = node.get_json("/health")
    return health["in_flight_requests"] == 0 and health["active_kv_caches"] == 0


def test_client_disconnect_mid_stream_stops_generation_and_frees_the_cache(
        node: NodeProcess, client: openai.OpenAI, model_id: str) -> None:  # noqa: F811
    max_tokens = 4000
    before = _generated_total(node)
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Go on forever."}], max_tokens=max_tokens,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # the role chunk
    for _ in range(5):
        assert next(chunks).choices[0].delta.content is not None
    debug = node.get_json("/v1/debug/requests")
    assert len(debug["requests"]) == 1 and debug["active_kv_caches"] == 1
    assert debug["requests"][0]["max_tokens"] == max_tokens
    stream.close()  # the client goes away mid-stream

    assert wait_for(lambda: _idle(node)), node.get_json("/v1/debug/requests")
    generated = _generated_total(node) - before
    assert 5 <= generated < max_tokens / 2
    assert wait_for(lambda: "client disconnected" in node.log())


def test_client_that_gives_up_on_a_whole_response_stops_generation(node: NodeProcess,  # noqa: F811
                                                                   model_id: str) -> None:
    max_tokens = 4000
    before = _generated_total(node)
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "Go on."}],
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    connection = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    in_flight = wait_for(lambda: node.get_json("/v1/debug/requests")["requests"], interval=0.005)
    assert in_flight and in_flight[0]["generated_tokens"] < max_tokens
    connection.close()  # gives up without reading the response

    assert wait_for(lambda: _idle(node))
    assert _generated_total(node) - before < max_tokens / 2
