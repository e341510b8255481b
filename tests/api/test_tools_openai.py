"""Tool calling through the official `openai` client, on a tiny random checkpoint whose chat template renders tools
(Hermes / Qwen2.5 style): a forced call (tool_choice required, or a named function) is always a well-formed call of
an offered tool whose arguments match its schema, streamed or not, as OpenAI shapes it (a named one exactly one
call, finish "stop"); a full round trip (the call, its result sent back) renders through the template and
answers."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from tests.api_server import NodeProcess, tools_checkpoint, tools_node  # noqa: F401  (fixtures)
from tests.oracle import Oracle

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server: NodeProcess):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_required_call_is_an_offered_tool_with_valid_arguments(tools_node: NodeProcess,  # noqa: F811
                                                                 tools_checkpoint: Path) -> None:  # noqa: F811
    for seed in range(3):
        reply = client(tools_node).chat.completions.create(
            model=str(tools_checkpoint), messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
            seed=seed, max_tokens=300, parallel_tool_calls=False)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        check_call(call.function.name, call.function.arguments)


def test_a_named_call_streams_as_openai_streams_one(tools_node: NodeProcess,  # noqa: F811
                                                    tools_checkpoint: Path) -> None:  # noqa: F811
    stream = client(tools_node).chat.completions.create(
        model=str(tools_checkpoint), messages=ASK, tools=TOOLS, stream=True, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    chunks = [chunk for chunk in stream if chunk.choices]
    deltas = [chunk.choices[0].delta for chunk in chunks]
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_time" and calls[0].function.arguments == ""
    assert {call.index for call in calls} == {0}
    check_call("get_time", "".join(call.function.arguments or "" for call in calls))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]  # OpenAI's
    assert not "".join(delta.content or "" for delta in deltas)


def test_a_named_call_is_exactly_one_call_and_stops(tools_node: NodeProcess,  # noqa: F811
                                                    tools_checkpoint: Path) -> None:  # noqa: F811
    """Parallel calls allowed or not, a named tool_choice is one call, then the end (before, the grammar let the
    model go on to more calls until max_tokens)."""
    for parallel in (True, False):
        for seed in range(3):
            reply = client(tools_node).chat.completions.create(
                model=str(tools_checkpoint), messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=300,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=parallel)
            choice = reply.choices[0]
            assert choice.finish_reason == "stop" and choice.message.content is None
            [call] = choice.message.tool_calls
            assert call.function.name == "get_weather"
            check_call(call.function.name, call.function.arguments)


def test_a_full_round_trip_answers_after_the_tool_result(tools_node: NodeProcess,  # noqa: F811
                                                         tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    first = api.chat.completions.create(model=str(tools_checkpoint), messages=ASK, tools=TOOLS, max_tokens=300,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    conversation = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = api.chat.completions.create(model=str(tools_checkpoint), messages=conversation, tools=TOOLS,
                                         tool_choice="none", max_tokens=8, temperature=0.0)
    assert second.choices[0].message.tool_calls is None
    # The answer: transformers' greedy text after the whole conversation, the call and its result rendered by the
    # checkpoint's template (its tools as OpenAI's function objects, a missing description empty, as the node
    # offers them to templates).
    oracle = Oracle(tools_checkpoint)
    template_tools = [{"type": "function", "function": {"name": tool["function"]["name"],
                                                        "description": tool["function"].get("description", ""),
                                                        "parameters": tool["function"]["parameters"]}}
                      for tool in TOOLS]
    rendered = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": call.function.name,
                                                      "arguments": json.loads(call.function.arguments)}}]},
                {"role": "tool", "content": '{"temperature": 21}'}]
    text = oracle.tokenizer.apply_chat_template(rendered, tools=template_tools, add_generation_prompt=True,
                                                tokenize=False)
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text  # the result, in the prompt
    prompt = tuple(oracle.tokenizer(text, add_special_tokens=False).input_ids)
    answer, finish, count = oracle.expected(prompt, 8)
    assert second.usage.prompt_tokens == len(prompt)
    assert (second.choices[0].message.content, second.choices[0].finish_reason) == (answer, finish)
    assert second.usage.completion_tokens == count
