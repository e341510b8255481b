"""The Responses API (POST /v1/responses) through the official `openai` client, on the tiny random checkpoint whose
chat template renders tools (the chat twin is test_tools_openai.py): text, streamed both ways (raw events and the
SDK's accumulator) to the same greedy text, instructions, forced function calls whose arguments match their
schemas and a round trip sending the call and its output back, structured output, an incomplete response, the
errors of what this stateless server does not do, an engine failure mid-stream (an `error` event), and a streamed
call round trip through a three-node ring. The client's pydantic types validate the wire shapes."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pydantic
import pytest

from tests.api_server import ARCH, NodeProcess, stop_nodes, tools_checkpoint, tools_node  # noqa: F401  (fixtures)

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["name"]: tool["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCE_WEATHER = {"type": "function", "name": "get_weather"}  # asked with parallel_tool_calls=False: one call, so
# max_output_tokens cannot cut a chain of calls that a random model may go on making (~1 in 60 without)
READING = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "degrees": {"type": "integer",
                                                                                     "minimum": -9, "maximum": 9}},
           "required": ["unit", "degrees"], "additionalProperties": False}


def client(server: NodeProcess):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def raw_response(server: NodeProcess, **body: object) -> dict:
    """The JSON as sent, validated against the client's Response type (the SDK itself does not validate)."""
    from openai.types.responses import Response

    status, _, raw = server.request("POST", "/v1/responses", json.dumps(body).encode(),
                                    {"Content-Type": "application/json"})
    assert status == 200, raw
    Response.model_validate(json.loads(raw))
    return json.loads(raw)


def raw_events(server: NodeProcess, **body: object) -> list[dict]:
    """A stream's events as sent: each `event:` line names its data's type, each validates as the client's event
    union, sequence numbers count from 0, and no [DONE] line ends it (OpenAI's Responses streams have none)."""
    from openai.types.responses import ResponseStreamEvent

    status, headers, raw = server.request("POST", "/v1/responses", json.dumps({**body, "stream": True}).encode(),
                                          {"Content-Type": "application/json"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), raw
    events = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        pydantic.TypeAdapter(ResponseStreamEvent).validate_python(event)
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_text_response_has_its_text_and_usage(tools_node: NodeProcess, tools_checkpoint: Path) -> None:  # noqa: F811
    reply = client(tools_node).responses.create(model=str(tools_checkpoint), input="Say hello.", max_output_tokens=8,
                                                temperature=0.0)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.output_text
    message = reply.output[0]
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert reply.usage.input_tokens > 5 and 1 <= reply.usage.output_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.temperature == 0.0 and reply.tool_choice == "auto" and reply.tools == []
    raw_response(tools_node, model=str(tools_checkpoint), input="Say hello.", max_output_tokens=8)


def without_ids(items: list[dict]) -> list[dict]:
    return [{key: value for key, value in item.items() if key != "id"} for item in items]


def test_streamed_both_ways_it_is_the_greedy_text(tools_node: NodeProcess, tools_checkpoint: Path) -> None:  # noqa: F811
    """Greedy text runs on to max_output_tokens on this checkpoint (incomplete); JSON under a schema completes."""
    api, model = client(tools_node), str(tools_checkpoint)
    for settings in ({"model": model, "input": ASK, "max_output_tokens": 12, "temperature": 0.0},
                     {"model": model, "input": ASK, "max_output_tokens": 60, "temperature": 0.0,
                      "text": {"format": {"type": "json_schema", "name": "reading", "schema": READING}}}):
        whole = api.responses.create(**settings)
        with api.responses.stream(**settings) as stream:  # the SDK's accumulator
            events = list(stream)
        text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
        assert events[-1].type == f"response.{whole.status}" and text == whole.output_text
        if whole.status == "completed":
            assert stream.get_final_response().output_text == text
        else:
            assert events[-1].response.output_text == text
        created = list(api.responses.create(**settings, stream=True))
        assert [e.type for e in created[:4]] == ["response.created", "response.in_progress",
                                                "response.output_item.added", "response.content_part.added"]
        assert [e.type for e in created[-4:-1]] == ["response.output_text.done", "response.content_part.done",
                                                   "response.output_item.done"]
        assert created[-1].response.output_text == created[-4].text == text
        raw = raw_events(tools_node, **settings)[-1]["response"]
        assert without_ids(raw["output"]) == without_ids(raw_response(tools_node, **settings)["output"])
    assert whole.status == "completed"  # (the JSON)


def test_instructions_come_first_and_are_echoed(tools_node: NodeProcess, tools_checkpoint: Path) -> None:  # noqa: F811
    from exo_like.api.responses_api import parse_responses_request

    # First: a system turn before every input item, a system (developer) message of the input's own included.
    items = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Bye"}]
    conversation = parse_responses_request({"model": "m", "instructions": "Answer in French.", "input": items})
    assert [(m["role"], m["content"]) for m in conversation.chat.messages] == [
        ("system", "Answer in French."), ("user", "Hi"), ("assistant", "Hello."), ("system", "Be kind."),
        ("user", "Bye")]
    # Through the node: the prompt and the greedy text of the chat whose first message is the instructions (this
    # template takes a system message only first: the instructions anywhere else would be a 400).
    api, model = client(tools_node), str(tools_checkpoint)
    plain = api.responses.create(model=model, input="Hi", max_output_tokens=2)
    told = api.responses.create(model=model, input="Hi", max_output_tokens=8, temperature=0.0,
                                instructions="Answer in French, briefly.")
    chat = api.chat.completions.create(model=model, max_tokens=8, temperature=0.0, messages=[
        {"role": "system", "content": "Answer in French, briefly."}, {"role": "user", "content": "Hi"}])
    assert told.instructions == "Answer in French, briefly." and plain.instructions is None
    assert told.usage.input_tokens == chat.usage.prompt_tokens > plain.usage.input_tokens
    assert told.output_text == chat.choices[0].message.content
    assert told.usage.output_tokens == chat.usage.completion_tokens


def test_a_named_function_call_and_its_round_trip(tools_node: NodeProcess, tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    first = api.responses.create(model=str(tools_checkpoint), input=ASK, tools=TOOLS, max_output_tokens=300,
                                 tool_choice=FORCE_WEATHER, parallel_tool_calls=False)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    assert call.name == "get_weather" and first.tool_choice.name == "get_weather"
    check_call(call.name, call.arguments)
    conversation = [*ASK, *(item.model_dump(exclude_none=True) for item in first.output),
                    {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    second = api.responses.create(model=str(tools_checkpoint), input=conversation, tools=TOOLS, tool_choice="none",
                                  max_output_tokens=8, temperature=0.0)
    assert [item.type for item in second.output] == ["message"] and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + 10  # the call and its output are in the prompt


def test_a_required_call_is_one_offered_tool_with_valid_arguments(tools_node: NodeProcess,  # noqa: F811
                                                                  tools_checkpoint: Path) -> None:  # noqa: F811
    for seed_text in ("Paris?", "Berlin?"):
        reply = client(tools_node).responses.create(
            model=str(tools_checkpoint), input=seed_text, tools=TOOLS, tool_choice="required", temperature=1.0,
            max_output_tokens=300, parallel_tool_calls=False)
        assert [item.type for item in reply.output] == ["function_call"] and reply.parallel_tool_calls is False
        check_call(reply.output[0].name, reply.output[0].arguments)


def test_a_streamed_call_announces_its_arguments(tools_node: NodeProcess, tools_checkpoint: Path) -> None:  # noqa: F811
    settings = {"model": str(tools_checkpoint), "input": ASK, "tools": TOOLS, "max_output_tokens": 300,
                "tool_choice": {"type": "function", "name": "get_time"}, "parallel_tool_calls": False}
    events = raw_events(tools_node, **settings)
    kinds = [event["type"] for event in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added, delta, done, item_done, completed = events[2:]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert delta["delta"] == done["arguments"] == item_done["item"]["arguments"]
    assert delta["item_id"] == added["item"]["id"] == item_done["item"]["id"]
    check_call("get_time", done["arguments"])
    assert completed["response"]["output"] == [item_done["item"]]
    with client(tools_node).responses.stream(**settings) as stream:
        final = stream.get_final_response()
    assert final.output[0].name == "get_time" and final.output[0].parsed_arguments is None  # (not strict)
    check_call("get_time", final.output[0].arguments)


def test_text_format_json_schema_gives_json_it_accepts(tools_node: NodeProcess,  # noqa: F811
                                                       tools_checkpoint: Path) -> None:  # noqa: F811
    reply = client(tools_node).responses.create(
        model=str(tools_checkpoint), input="The weather as JSON.", max_output_tokens=200, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "reading", "schema": READING, "strict": True}})
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    jsonschema.validate(json.loads(reply.output_text), READING)


def test_max_output_tokens_makes_it_incomplete(tools_node: NodeProcess, tools_checkpoint: Path) -> None:  # noqa: F811
    settings = {"model": str(tools_checkpoint), "input": ASK, "max_output_tokens": 3, "temperature": 0.0}
    reply = raw_response(tools_node, **settings)
    assert reply["status"] == "incomplete" and reply["incomplete_details"] == {"reason": "max_output_tokens"}
    assert reply["output"][0]["status"] == "incomplete" and reply["usage"]["output_tokens"] == 3
    events = raw_events(tools_node, **settings)
    assert events[-1]["type"] == "response.incomplete"
    assert without_ids(events[-1]["response"]["output"]) == without_ids(reply["output"])


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_abc", "store": True}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "21"}]}, "input[0].call_id"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_stock"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "bad", "schema": {"type": "no-such-type"}}}},
     "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_it_does_not_do_is_a_400_naming_the_field(tools_node: NodeProcess, tools_checkpoint: Path,  # noqa: F811
                                                        body: dict, param: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as failure:
        client(tools_node).responses.create(**{"model": str(tools_checkpoint), "input": "Hi", **body})
    assert failure.value.status_code == 400 and failure.value.type == "invalid_request_error"
    assert failure.value.param == param and failure.value.message.startswith("Error code: 400")
    assert set(failure.value.body) == {"message", "type", "param", "code"}


async def test_a_failure_mid_stream_is_an_error_event(tools_checkpoint: Path, tmp_path: Path) -> None:  # noqa: F811
    """In-process, to break the engine: the stream's last event is an `error` with OpenAI's fields."""
    from aiohttp.test_utils import TestClient, TestServer

    from exo_like.api.routes import create_app
    from exo_like.node import Node, NodeOptions

    node = Node(NodeOptions(home=tmp_path, engine="torch", dtype="float32", mdns=False, model=str(tools_checkpoint)))
    async with TestClient(TestServer(create_app(node))) as http:
        await node.start("127.0.0.1", http.port)
        await node.instances.oldest().wait_ready(60)
        real_step, steps = node.instances.oldest().part.engine.step, []

        def failing_step(*args: object):  # noqa: ANN202
            steps.append(1)
            if len(steps) == 4:
                raise RuntimeError("simulated device failure")
            return real_step(*args)

        node.instances.oldest().part.engine.step = failing_step
        response = await http.post("/v1/responses", json={"model": str(tools_checkpoint), "input": "Hi",
                                                           "stream": True, "max_output_tokens": 10})
        events = [json.loads(line[len("data: "):]) for line in (await response.text()).splitlines()
                  if line.startswith("data: ")]
    await node.close()
    assert response.status == 200 and events[2]["type"] == "response.output_item.added"
    assert events[-1]["type"] == "error" and "simulated device failure" in events[-1]["message"]
    assert events[-1]["code"] == "stage_failed" and events[-1]["sequence_number"] == len(events) - 1
