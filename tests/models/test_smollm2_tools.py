"""Tools on the real SmolLM2 (whose chat template cannot show them: the generic format), through the official
`openai` client against an in-process node: tool_choice auto, required, a named function and none each give a
valid answer (a call of an offered tool whose arguments fit its schema, or text), a named one exactly one call
with finish "stop"; and Anthropic's thinking switch, which a model that does not reason takes and ignores."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer

from exo_like.api.routes import create_app
from exo_like.api.tool_calls.detect import detect
from exo_like.models.gguf.file import open_gguf
from exo_like.models.gguf.tokenizer import gguf_tokenizer
from exo_like.node import Node, NodeOptions

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture
async def api(smollm2: Path, tmp_path: Path) -> AsyncIterator:
    """(an openai client of an in-process node serving SmolLM2, the node's address)"""
    import openai

    node = Node(NodeOptions(home=tmp_path, engine="torch", mdns=False, model="smollm2-135m"))
    async with TestClient(TestServer(create_app(node))) as http:
        await node.start("127.0.0.1", http.port)
        await node.instances.oldest().wait_ready(60)
        yield (openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="x", max_retries=0,
                                  timeout=60), f"http://127.0.0.1:{http.port}")
    await node.close()


def valid_calls(message, count: int | None = None) -> list[str]:  # noqa: ANN001
    """The names of a message's calls, each checked against its tool's schema."""
    assert message.tool_calls and (count is None or len(message.tool_calls) == count), message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [call.function.name for call in message.tool_calls]


async def ask(api, tool_choice: object, max_tokens: int = 60):  # noqa: ANN001, ANN201
    reply = await api.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS,
                                              tool_choice=tool_choice, max_tokens=max_tokens, temperature=0)
    return reply.choices[0]


@pytest.mark.slow  # (about 15 s: the model's load, its vocabulary's grammar tokenizer, four answers)
async def test_smollm2_answers_with_tools_for_every_tool_choice(api, smollm2: Path) -> None:  # noqa: ANN001
    api, node_url = api
    template = gguf_tokenizer(open_gguf(smollm2).metadata, smollm2.name).chat_template_source
    assert detect("llama", template) is None  # no format of its own: the generic one
    named = await ask(api, {"type": "function", "function": {"name": "get_time"}})
    assert named.finish_reason == "stop" and named.message.content is None
    assert valid_calls(named.message, 1) == ["get_time"]
    required = await ask(api, "required")
    assert required.finish_reason == "tool_calls" and required.message.content is None
    valid_calls(required.message)
    none = await ask(api, "none", max_tokens=20)
    assert none.message.tool_calls is None and none.message.content.strip()
    auto = await ask(api, "auto")
    if auto.message.tool_calls:  # the model's choice: either is valid
        assert auto.finish_reason == "tool_calls"
        valid_calls(auto.message)
    else:
        assert auto.message.content.strip() and not auto.message.content.lstrip().startswith("{")

    import anthropic

    claude = anthropic.AsyncAnthropic(base_url=node_url, api_key="x", max_retries=0, timeout=60)
    thought = await claude.messages.create(model="smollm2-135m", max_tokens=12, messages=ASK,
                                           thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in thought.content] == ["text"] and thought.content[0].text.strip(), thought
