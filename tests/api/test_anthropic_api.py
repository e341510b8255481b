"""The Anthropic Messages API through the official `anthropic` client, on the tiny random checkpoint whose chat
template renders tools (Hermes / Qwen2.5 style): messages and their usage, the stream the SDK accumulates into the
same message, system prompts, stop sequences, forced tool calls and a full tool round trip (streamed too), token
counting, and errors in Anthropic's shape through the SDK's exception classes. The OpenAI twin of the tool tests is
tests/api/test_tools_openai.py."""

from __future__ import annotations

from pathlib import Path

import anthropic
import jsonschema
import pytest

from exo_like.api.anthropic_api import parse_messages_request
from exo_like.errors import InvalidRequestError
from exo_like.serving.stop_strings import StopStringFilter
from tests.api_server import NodeProcess, stop_nodes, tools_checkpoint, tools_node  # noqa: F401  (fixtures)

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "unit": {"enum": ["C", "F"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                             "required": ["zone"], "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# One call: a random model offered parallel calls may chain them until max_tokens cuts the last one (~1 in 60).
FORCE_WEATHER = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
# This SDK has no sampling arguments any more (Anthropic's newest models refuse them); the API still takes them.
GREEDY = {"temperature": 0}


def prompt_tokens(message) -> int:  # type: ignore[no-untyped-def]
    """The prompt's tokens as Anthropic counts them in a reply: those read from the cache are apart."""
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def client(node: NodeProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.base_url, api_key="x", max_retries=0, timeout=120)


def tool_uses(message: anthropic.types.Message) -> list[anthropic.types.ToolUseBlock]:
    return [block for block in message.content if block.type == "tool_use"]


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def check_calls(message: anthropic.types.Message, names: set[str]) -> None:
    """Every block a call of one of `names`, its input valid against the tool's schema; at least one call."""
    calls = tool_uses(message)
    assert calls and message.stop_reason == "tool_use", message
    for call in calls:
        assert call.name in names and call.id.startswith("toolu_")
        jsonschema.validate(call.input, SCHEMAS[call.name])


def test_the_stop_filter_names_the_stop_string_that_matched() -> None:
    stops = StopStringFilter(["never", "lo w", "world"])
    assert stops.feed("hel") == "he" and stops.matched is None  # "l" may begin "lo w": held back
    assert stops.feed("lo world") == "l" and stops.stopped and stops.matched == "lo w"  # the earliest, not "world"


def test_a_conversation_becomes_chat_template_messages() -> None:
    """Blocks to messages: the system blocks joined, an assistant turn's tool_use blocks its tool calls (earlier
    thinking left out), a user turn's tool results one tool message each (named after their call), then its text."""
    request = parse_messages_request({
        "model": "m", "max_tokens": 4,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Ok"}],
        "stop_sequences": ["\n\n"], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "tools": TOOLS,
        "messages": [*ASK, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "C"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "21"}]},
                                         {"type": "text", "text": "And tomorrow?"}]}]})
    assert request.messages == [
        {"role": "system", "content": "Be brief.\nOk"}, *ASK,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Paris", "unit": "C"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21", "name": "get_weather"},
        {"role": "user", "content": "And tomorrow?"}]
    use = request.tool_use
    assert use is not None and (use.choice, use.name, use.parallel) == ("required", None, False)
    assert [tool.name for tool in use.tools] == ["get_weather", "get_time"]
    assert request.options.max_tokens == 4 and request.options.stop == ("\n\n",)
    assert request.options.sampling.temperature == 1.0  # Anthropic's default


@pytest.mark.parametrize("odd", [
    {"messages": "hi"}, {"messages": [{"role": "user", "content": 3}]}, {"messages": [{"role": "tool", "content": ""}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ["toolu_1"]}]}]},
    {"tool_choice": {"type": ["any"]}}, {"tool_choice": {"type": "tool"}}, {"tools": [{"type": ["custom"]}]},
    {"tools": [{"name": "x"}]}, {"system": [{"type": "image"}]}, {"stop_sequences": [""]}, {"top_k": -1},
    {"max_tokens": 0}, {"service_tier": "priority"}, {"thinking": {"type": "sometimes"}},
    {"thinking": {"type": "enabled"}}, {"thinking": {"type": "enabled", "budget_tokens": 0}}])
def test_odd_shapes_are_invalid_requests(odd: dict) -> None:
    with pytest.raises(InvalidRequestError):
        parse_messages_request({"model": "m", "max_tokens": 4, "messages": ASK, **odd})


def test_a_message_has_text_and_usage_and_counts_its_prompt(tools_node: NodeProcess,  # noqa: F811
                                                            tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    reply = api.messages.create(model=str(tools_checkpoint), max_tokens=8, messages=ASK, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.model == tools_checkpoint.name  # the model id: its folder
    assert [block.type for block in reply.content] in (["text"], [])
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert 0 < reply.usage.output_tokens <= 8 and prompt_tokens(reply) > 5
    assert (reply.stop_reason == "max_tokens") == (reply.usage.output_tokens == 8)
    counted = api.messages.count_tokens(model=str(tools_checkpoint), messages=ASK)
    assert counted.input_tokens == prompt_tokens(reply)
    with_tools = api.messages.count_tokens(model=str(tools_checkpoint), messages=ASK, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens + 20  # the template shows the tools


def test_a_stream_accumulates_into_the_same_message(tools_node: NodeProcess,  # noqa: F811
                                                    tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    request = {"model": str(tools_checkpoint), "max_tokens": 12, "messages": ASK, "extra_body": GREEDY}
    whole = api.messages.create(**request)
    with api.messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.content and text_of(streamed) == text_of(whole)
    assert (streamed.stop_reason, streamed.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert prompt_tokens(streamed) == prompt_tokens(whole)
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"


def test_a_system_prompt_as_text_or_as_blocks_is_the_same_prompt(tools_node: NodeProcess,  # noqa: F811
                                                                 tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    request = {"model": str(tools_checkpoint), "max_tokens": 6, "messages": ASK, "extra_body": GREEDY}
    plain = api.messages.create(**request)
    as_text = api.messages.create(**request, system="Answer in one word.")
    as_blocks = api.messages.create(**request, system=[
        {"type": "text", "text": "Answer in one word.", "cache_control": {"type": "ephemeral"}}])
    assert prompt_tokens(as_text) == prompt_tokens(as_blocks) > prompt_tokens(plain)
    assert text_of(as_text) == text_of(as_blocks)


def test_a_stop_sequence_cuts_the_text_and_is_named(tools_node: NodeProcess,  # noqa: F811
                                                    tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    request = {"model": str(tools_checkpoint), "max_tokens": 16, "messages": ASK, "extra_body": GREEDY}
    text = text_of(api.messages.create(**request))
    assert len(text) >= 6, text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    reply = api.messages.create(**request, stop_sequences=["never in this text \u2603", stop])
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    assert text_of(reply) == text[:text.index(stop)]
    with api.messages.stream(**request, stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, text_of(streamed)) == (
        "stop_sequence", stop, text_of(reply))


def test_a_forced_tool_call_and_its_result_make_a_round_trip(tools_node: NodeProcess,  # noqa: F811
                                                             tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    first = api.messages.create(model=str(tools_checkpoint), max_tokens=200, messages=ASK, tools=TOOLS,
                                tool_choice=FORCE_WEATHER)
    check_calls(first, {"get_weather"})
    results = [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'}
               for call in tool_uses(first)]
    conversation = [*ASK, first.to_param(), {"role": "user", "content": [*results, {"type": "text", "text": "So?"}]}]
    second = api.messages.create(model=str(tools_checkpoint), max_tokens=8, messages=conversation, tools=TOOLS,
                                 tool_choice={"type": "none"}, extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens") and not tool_uses(second)
    assert prompt_tokens(second) > prompt_tokens(first) + 10  # the call and its result are in the prompt
    counted = api.messages.count_tokens(model=str(tools_checkpoint), messages=conversation, tools=TOOLS,
                                        tool_choice={"type": "none"})
    assert counted.input_tokens == prompt_tokens(second)


def test_a_streamed_tool_call_accumulates_into_the_same_input(tools_node: NodeProcess,  # noqa: F811
                                                              tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    request = {"model": str(tools_checkpoint), "max_tokens": 200, "messages": ASK, "tools": TOOLS,
               "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
               "extra_body": GREEDY}
    whole = api.messages.create(**request)
    with api.messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    check_calls(streamed, {"get_time"})
    assert [(c.name, c.input) for c in tool_uses(streamed)] == [(c.name, c.input) for c in tool_uses(whole)]
    starts = [e.content_block for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert len(starts) == 1 and starts[0].input == {} and starts[0].id == tool_uses(streamed)[0].id
    assert [e.delta.type for e in events if e.type == "content_block_delta"] == ["input_json_delta"]


def test_tool_choice_any_makes_one_call_of_an_offered_tool(tools_node: NodeProcess,  # noqa: F811
                                                           tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    for question in ("Paris?", "What time is it?"):
        reply = api.messages.create(model=str(tools_checkpoint), max_tokens=200, tools=TOOLS,
                                    messages=[{"role": "user", "content": question}],
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
        check_calls(reply, {"get_weather", "get_time"})
        assert len(tool_uses(reply)) == 1


BAD_REQUESTS = {
    "max_tokens": {"messages": ASK},
    "messages[1]": {"max_tokens": 4, "messages": [*ASK, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_never_made", "content": "21"}]}]},
    "get_nothing": {"max_tokens": 4, "messages": ASK, "tools": TOOLS,
                    "tool_choice": {"type": "tool", "name": "get_nothing"}},
    "text only": {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
    "web_search_20250305": {"max_tokens": 4, "messages": ASK,
                            "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    "thinking": {"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled"}},  # no budget_tokens
    "before any text": {"max_tokens": 4, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [{"type": "text", "text": "Here:"},
                                     {"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"}]}]},
    "output_config.format": {"max_tokens": 4, "messages": ASK, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object"}}}},
    "temperature": {"max_tokens": 4, "messages": ASK, "temperature": 1.5},
}


@pytest.mark.parametrize("named", BAD_REQUESTS)
def test_a_bad_request_is_a_400_in_anthropic_shape(tools_node: NodeProcess, tools_checkpoint: Path,  # noqa: F811
                                                   named: str) -> None:
    body = {"model": str(tools_checkpoint), **BAD_REQUESTS[named]}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(tools_node).post("/v1/messages", cast_to=object, body=body)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert named in caught.value.body["error"]["message"]


def test_route_and_model_errors_are_in_anthropic_shape(tools_node: NodeProcess,  # noqa: F811
                                                       tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    with pytest.raises(anthropic.NotFoundError) as unknown_route:
        api.post("/v1/messages/x", cast_to=object, body={})
    with pytest.raises(anthropic.NotFoundError) as unknown_model:
        api.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.APIStatusError) as wrong_method:
        api.get("/v1/messages", cast_to=object)
    for caught, kind in ((unknown_route, "not_found_error"), (unknown_model, "not_found_error"),
                         (wrong_method, "invalid_request_error")):
        body = caught.value.body
        assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    assert wrong_method.value.status_code == 405 and wrong_method.value.response.headers["Allow"] == "POST"
