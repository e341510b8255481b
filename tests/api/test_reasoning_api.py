"""Reasoning apart from the answer, through the official clients against in-process nodes on generated checkpoints
whose templates reason: a Qwen3-style one (the model opens <think>), a DeepSeek R1-style one (the prompt opens it)
and a harmony one (gpt-oss's analysis channel). The weights are random, so each request steers the model through the
markers with a grammar (vLLM's structured_outputs), or lets it ramble where what is checked (a budget, the off
switch) does not depend on what it says."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from exo_like.api.routes import create_app
from exo_like.node import Node, NodeOptions
from tests.chat_templates import HARMONY_TEMPLATE, OPENED_THINK_TEMPLATE, THINK_TEMPLATE
from tests.checkpoints import make_checkpoint

ASK = [{"role": "user", "content": "Why is the sky blue?"}]
WORDS = 'words: WORD " " WORD " " WORD\nWORD: /[a-z]{1,6}/\n'
THREE_WORDS = re.compile(r"^[a-z]+ [a-z]+ [a-z]+$")
# The model's reasoning, then its answer, each three words (the harmony one with its channels).
THINK_THEN_ANSWER = 'start: "<think>" words "</think>" words\n' + WORDS
CLOSE_THEN_ANSWER = 'start: words "</think>" words\n' + WORDS
HARMONY_CHANNELS = ('start: "<|channel|>analysis<|message|>" words '
                    '"<|end|><|start|>assistant<|channel|>final<|message|>" words\n' + WORDS)
TEMPLATES = {"think": THINK_TEMPLATE, "opened": OPENED_THINK_TEMPLATE, "harmony": HARMONY_TEMPLATE,
             "plain": None}  # the test tokenizer's own template: a model that does not reason


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reasoning")
    return {name: make_checkpoint(root / name, "llama", n_layers=2, chat_template=template)
            for name, template in TEMPLATES.items()}


@pytest.fixture
async def served(request: pytest.FixtureRequest, checkpoints: dict[str, Path],
                 tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(base URL, model name) of a node serving the template the test names (its `template` parameter)."""
    path = checkpoints[request.param]
    node = Node(NodeOptions(home=tmp_path, engine="torch", dtype="float32", mdns=False, model=str(path)))
    async with TestClient(TestServer(create_app(node))) as http:
        await node.start("127.0.0.1", http.port)
        await node.instances.oldest().wait_ready(60)
        yield f"http://127.0.0.1:{http.port}", path.name
    await node.close()


def openai_client(base_url: str):  # noqa: ANN201
    import openai

    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def steered(grammar: str, **more: object) -> dict[str, object]:
    return {"temperature": 0, "max_tokens": 160, "extra_body": {"structured_outputs": {"grammar": grammar}, **more}}


async def chat_both_ways(base_url: str, model: str, **kwargs: object) -> tuple[tuple[str | None, str], tuple[str, str]]:
    """((reasoning, answer) whole, (reasoning, answer) joined from the stream) of one greedy request."""
    client = openai_client(base_url)
    whole = (await client.chat.completions.create(model=model, messages=ASK, **kwargs)).choices[0].message
    reasoning, answer = [], []
    async for chunk in await client.chat.completions.create(model=model, messages=ASK, stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            answer.append(delta.content or "")
    return (getattr(whole, "reasoning_content", None), whole.content), ("".join(reasoning), "".join(answer))


@pytest.mark.parametrize(("served", "grammar"), [("think", THINK_THEN_ANSWER), ("opened", CLOSE_THEN_ANSWER),
                                                 ("harmony", HARMONY_CHANNELS)], indirect=["served"])
async def test_openai_chat_gives_the_reasoning_apart_whole_and_streamed(served: tuple[str, str],
                                                                        grammar: str) -> None:
    whole, streamed = await chat_both_ways(*served, **steered(grammar))
    reasoning, answer = whole
    assert THREE_WORDS.match(reasoning or "") and THREE_WORDS.match(answer), whole
    assert streamed == whole


@pytest.mark.parametrize("served", ["opened"], indirect=True)
async def test_thinking_off_gives_no_reasoning(served: tuple[str, str]) -> None:
    """The prompt opened the block: on, everything is reasoning (it never closes here); off, the block is closed in
    the prompt and the same words are the answer."""
    on, _ = await chat_both_ways(*served, **steered('start: words\n' + WORDS))
    assert on[0] is not None and THREE_WORDS.match(on[0]) and on[1] == "", on
    off, streamed = await chat_both_ways(*served, **steered('start: words\n' + WORDS,
                                                            chat_template_kwargs={"enable_thinking": False}))
    assert off[0] is None and THREE_WORDS.match(off[1]), off
    assert streamed == ("", off[1])
    effort_none, _ = await chat_both_ways(*served, reasoning_effort="none", **steered('start: words\n' + WORDS))
    assert effort_none == off


@pytest.mark.parametrize("served", ["think"], indirect=True)
async def test_a_model_that_opens_its_own_block_is_closed_for_it_when_thinking_is_off(served: tuple[str, str]) -> None:
    """The template renders the closed empty block itself when enable_thinking is false: the model's words are the
    answer, and its own <think> would be answer text."""
    off, _ = await chat_both_ways(*served, **steered('start: words\n' + WORDS,
                                                     chat_template_kwargs={"enable_thinking": False}))
    assert off[0] is None and THREE_WORDS.match(off[1]), off


def anthropic_client(base_url: str):  # noqa: ANN201
    import anthropic

    return anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("served", ["think"], indirect=True)
async def test_anthropic_gives_thinking_blocks_whole_and_streamed(served: tuple[str, str]) -> None:
    base_url, model = served
    client = anthropic_client(base_url)
    steering = {"structured_outputs": {"grammar": THINK_THEN_ANSWER}, "temperature": 0}
    whole = await client.messages.create(model=model, max_tokens=160, messages=ASK, extra_body=steering,
                                         thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in whole.content] == ["thinking", "text"], whole.content
    assert THREE_WORDS.match(whole.content[0].thinking) and THREE_WORDS.match(whole.content[1].text), whole.content
    async with client.messages.stream(model=model, max_tokens=160, messages=ASK, extra_body=steering,
                                      thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        kinds = [event.delta.type async for event in stream if event.type == "content_block_delta"]
        streamed = await stream.get_final_message()
    assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in whole.content]
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"


@pytest.mark.parametrize("served", ["opened"], indirect=True)
async def test_a_budget_closes_the_thinking_at_its_count_and_the_answer_follows(served: tuple[str, str]) -> None:
    """The prompt opened the block and the random model never closes it by itself: without a budget, everything
    is reasoning; with budget_tokens 5, the reasoning is the first 5 of those greedy tokens, then it is closed and
    an answer comes."""
    base_url, model = served
    free = (await openai_client(base_url).chat.completions.create(model=model, messages=ASK, max_tokens=24,
                                                                  temperature=0, logprobs=True)).choices[0]
    assert free.message.content == "" and free.message.reasoning_content, free.message
    first_five = "".join(entry.token for entry in free.logprobs.content[:5]).strip()
    budgeted = await anthropic_client(base_url).messages.create(
        model=model, max_tokens=24, messages=ASK, extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": 5})
    assert [block.type for block in budgeted.content] == ["thinking", "text"], budgeted.content
    assert budgeted.content[0].thinking == first_five, (budgeted.content[0].thinking, first_five)
    assert budgeted.usage.output_tokens <= 24


@pytest.mark.parametrize("served", ["think"], indirect=True)
async def test_ollama_gives_thinking_apart_and_think_false_turns_it_off(served: tuple[str, str]) -> None:
    import aiohttp

    base_url, model = served
    options = {"temperature": 0, "num_predict": 160}

    async def chat(grammar: str, **kwargs: object) -> tuple[dict, tuple[str, str]]:
        """(the whole reply's message, (thinking, content) joined from the stream)."""
        body = {"model": model, "messages": ASK, "options": options, "structured_outputs": {"grammar": grammar},
                **kwargs}
        async with aiohttp.ClientSession() as session:
            async with session.post(base_url + "/api/chat", json={**body, "stream": False}) as reply:
                message = (await reply.json())["message"]
            async with session.post(base_url + "/api/chat", json={**body, "stream": True}) as reply:
                lines = [json.loads(line) for line in (await reply.text()).splitlines()]
        return message, ("".join(line["message"].get("thinking", "") for line in lines),
                         "".join(line["message"]["content"] for line in lines))

    message, streamed = await chat(THINK_THEN_ANSWER, think=True)
    assert THREE_WORDS.match(message["thinking"]) and THREE_WORDS.match(message["content"]), message
    assert streamed == (message["thinking"], message["content"])
    message, _ = await chat('start: words\n' + WORDS, think=False)
    assert "thinking" not in message and THREE_WORDS.match(message["content"]), message


@pytest.mark.parametrize("served", ["think"], indirect=True)
async def test_responses_gives_a_reasoning_item_before_the_message(served: tuple[str, str]) -> None:
    base_url, model = served
    client = openai_client(base_url)
    steering = {"temperature": 0, "max_output_tokens": 160,
                "extra_body": {"structured_outputs": {"grammar": THINK_THEN_ANSWER}}}
    whole = await client.responses.create(model=model, input="Why is the sky blue?", reasoning={"effort": "high"},
                                          **steering)
    assert [item.type for item in whole.output] == ["reasoning", "message"], whole.output
    thought, answer = whole.output[0].content[0].text, whole.output[1].content[0].text
    assert THREE_WORDS.match(thought) and THREE_WORDS.match(answer), whole.output
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    deltas = []
    async for event in await client.responses.create(model=model, input="Why is the sky blue?", stream=True,
                                                     **steering):
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            streamed = event.response
    assert "".join(deltas) == thought
    assert [item.model_dump() for item in streamed.output][0]["content"] == \
        [item.model_dump() for item in whole.output][0]["content"]


@pytest.mark.parametrize("served", ["plain"], indirect=True)
async def test_a_model_that_does_not_reason_takes_every_switch_and_ignores_it(served: tuple[str, str]) -> None:
    import ollama

    base_url, model = served
    claude = await anthropic_client(base_url).messages.create(
        model=model, max_tokens=8, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in claude.content] == ["text"], claude.content
    chat = await openai_client(base_url).chat.completions.create(
        model=model, messages=ASK, max_tokens=8, reasoning_effort="high",
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert chat.choices[0].message.content and getattr(chat.choices[0].message, "reasoning_content", None) is None
    reply = await ollama.AsyncClient(host=base_url).chat(model=model, messages=ASK, think=True,
                                                         options={"num_predict": 8})
    assert reply.message.content and not reply.message.thinking
