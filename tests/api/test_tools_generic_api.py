"""Tools on a model whose chat template cannot show them (the test checkpoint's demo template), through the official
`openai` and `anthropic` clients against an in-process node: the tools are offered in the generic format's system
message; tool_choice none answers in text; required and named choices are calls held by the grammar (a named one
exactly one call, finish "stop"); auto is text or a valid call, whichever the model starts (steered here with
logit_bias, the weights being random)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer

from exo_like.api.routes import create_app
from exo_like.api.tool_calls import Tool
from exo_like.api.tool_calls.generic import prompt_messages
from exo_like.models.tokenizer import ModelTokenizer
from exo_like.node import Node, NodeOptions
from tests.api_server import checkpoint  # noqa: F401  (fixture)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
async def served(checkpoint: Path, tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:  # noqa: F811
    node = Node(NodeOptions(home=tmp_path, engine="torch", dtype="float32", mdns=False, model=str(checkpoint)))
    async with TestClient(TestServer(create_app(node))) as http:
        await node.start("127.0.0.1", http.port)
        await node.instances.oldest().wait_ready(60)
        yield f"http://127.0.0.1:{http.port}", checkpoint
    await node.close()


def openai_client(base_url: str):  # noqa: ANN201
    import openai

    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def check_calls(calls: list, count: int | None = None) -> None:  # noqa: ANN001
    assert calls and (count is None or len(calls) == count)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def token_of(model_dir: Path, text: str) -> str:
    """The one token of `text`, as logit_bias names it."""
    [token] = ModelTokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)
    return str(token)


async def test_tool_choice_none_answers_in_text_without_the_tools(served) -> None:  # noqa: ANN001
    base_url, path = served
    api = openai_client(base_url)
    reply = await api.chat.completions.create(model=str(path), messages=ASK, tools=TOOLS, tool_choice="none",
                                              max_tokens=6, temperature=0.0)
    plain = await api.chat.completions.create(model=str(path), messages=ASK, max_tokens=6, temperature=0.0)
    assert reply.choices[0].message.tool_calls is None
    # No tools in the prompt: the same prompt and answer as without them.
    assert (reply.usage.prompt_tokens, reply.choices[0].message.content) == \
           (plain.usage.prompt_tokens, plain.choices[0].message.content)


async def test_required_is_calls_in_the_generic_format(served) -> None:  # noqa: ANN001
    base_url, path = served
    tokenizer = ModelTokenizer.from_dir(path)
    tools = [Tool(t["function"]["name"], t["function"].get("description"), t["function"]["parameters"])
             for t in TOOLS]
    # Parallel calls go on while the random model does not close their list: "]" favoured here, the first call
    # closes it (the grammar allows "]" only after a whole call).
    for parallel in (True, False):
        reply = await openai_client(base_url).chat.completions.create(
            model=str(path), messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
            max_tokens=400, temperature=1.0, seed=3, logit_bias={token_of(path, "]"): 100} if parallel else None)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, None if parallel else 1)
        # The prompt: the template's rendering of the conversation with the tools' system message first.
        assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(prompt_messages(ASK, tools, parallel)))


async def test_a_named_choice_is_exactly_one_call_and_stops(served) -> None:  # noqa: ANN001
    base_url, path = served
    api = openai_client(base_url)
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = await api.chat.completions.create(model=str(path), messages=ASK, tools=TOOLS, tool_choice=named,
                                              max_tokens=400, temperature=1.0, seed=0)
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content is None
    check_calls(reply.choices[0].message.tool_calls, 1)
    assert reply.choices[0].message.tool_calls[0].function.name == "get_time"
    stream = await api.chat.completions.create(model=str(path), messages=ASK, tools=TOOLS, tool_choice=named,
                                               max_tokens=400, stream=True)
    chunks = [chunk async for chunk in stream if chunk.choices]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert {call.index for call in calls} == {0} and calls[0].function.name == "get_time"
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


async def test_anthropic_names_a_tool_and_gets_tool_use(served) -> None:  # noqa: ANN001
    import anthropic

    base_url, path = served
    api = anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    message = await api.messages.create(model=str(path), messages=ASK, tools=tools, max_tokens=400,
                                        tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    jsonschema.validate(block.input, SCHEMAS["get_weather"])


async def test_auto_is_a_valid_call_when_the_answer_starts_one_and_text_otherwise(served) -> None:  # noqa: ANN001
    base_url, path = served
    api = openai_client(base_url)
    brace, close = token_of(path, "{"), token_of(path, "]")
    for parallel in (True, False):  # (a favoured "]" ends a list of parallel calls after the first, as above)
        call = await api.chat.completions.create(model=str(path), messages=ASK, tools=TOOLS, max_tokens=400,
                                                 temperature=1.0, seed=1, logit_bias={brace: 100, close: 100},
                                                 parallel_tool_calls=parallel)
        assert call.choices[0].finish_reason == "tool_calls" and call.choices[0].message.content is None
        check_calls(call.choices[0].message.tool_calls, 1)
    text = await api.chat.completions.create(model=str(path), messages=ASK, tools=TOOLS, max_tokens=12,
                                             temperature=1.0, seed=1, logit_bias={brace: -100})
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    assert not text.choices[0].message.content.lstrip().startswith("{")


async def test_a_round_trip_shows_the_call_and_its_result_as_text(served) -> None:  # noqa: ANN001
    base_url, path = served
    api = openai_client(base_url)
    first = await api.chat.completions.create(model=str(path), messages=ASK, tools=TOOLS, max_tokens=400,
                                              tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = first.choices[0].message.tool_calls[0]
    conversation = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    second = await api.chat.completions.create(model=str(path), messages=conversation, tools=TOOLS, max_tokens=4,
                                               tool_choice="none")
    assert second.choices[0].message.tool_calls is None
    # The template saw the call as the assistant's JSON and the result as a user message (no tools: none).
    shown = [*ASK, {"role": "assistant", "content": '{"tool_call": {"name": "get_time", "arguments": '
                                                    f'{call.function.arguments}}}}}'},
             {"role": "user", "content": json.dumps({"tool_result": {"id": call.id, "name": "get_time",
                                                                     "content": "12:00"}})}]
    assert second.usage.prompt_tokens == len(ModelTokenizer.from_dir(path).encode_chat(shown))
