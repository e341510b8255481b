"""Every dialect through one 3-node ring of processes on this host (three layers, one per node: the last stage
samples, so masks, calls and log-probabilities all happen there), asked at a node that is not the last stage, with
the official clients: OpenAI tool calls streamed and round-tripped, structured output and log-probabilities; an
Anthropic streamed tool round trip; a Responses streamed function call round trip; Ollama's chat stream held to a
schema, generate, list, show and ps."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.api import test_anthropic_api as anthropic_case
from tests.api import test_ollama_api as ollama_case
from tests.api import test_responses_api as responses_case
from tests.api.test_tools_openai import ASK, SCHEMAS, TOOLS, check_call
from tests.api_server import ARCH, NodeProcess, stop_nodes
from tests.chat_templates import HERMES_TOOLS_TEMPLATE
from tests.checkpoints import make_checkpoint
from tests.cluster_harness import cluster_of, start_cluster, wait_until_ready

RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The API tests' tools checkpoint with three layers: one for each node."""
    return make_checkpoint(tmp_path_factory.mktemp("ring") / "tools3", ARCH, n_layers=3,
                           chat_template=HERMES_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def entry(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node of a ready 3-stage ring that is not its last stage: its requests' tokens come back over the ring."""
    nodes = start_cluster(tmp_path_factory.mktemp("ring"), str(model), [1, 1, 1], extra=("--placement", "memory"))
    try:
        wait_until_ready(nodes, members=3)
        stages = cluster_of(nodes[0])["plan"]["stages"]
        assert len(stages) == 3
        yield next(node for node in nodes if node.get_json("/health")["node_id"] != stages[-1]["node_id"])
    finally:
        exit_codes = stop_nodes(nodes)
    assert exit_codes == [0, 0, 0] and not any("Traceback" in node.log() for node in nodes)


def test_openai_tool_calls_structured_output_and_logprobs(entry: NodeProcess, model: Path) -> None:
    import openai

    api = openai.OpenAI(base_url=entry.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = api.chat.completions.create(model=str(model), messages=ASK, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=3, max_tokens=300, stream=True)
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            into = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            into["arguments"] += call.function.arguments or ""
    assert calls and all(call["name"] in SCHEMAS for call in calls.values())
    for call in calls.values():
        check_call(call["name"], call["arguments"])
    conversation = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()]}, *({"role": "tool", "tool_call_id": c["id"], "content": "21 C"}
                                     for c in calls.values())]
    answer = api.chat.completions.create(model=str(model), messages=conversation, tools=TOOLS, max_tokens=6,
                                         temperature=0.0, logprobs=True, top_logprobs=2)
    tokens = answer.choices[0].logprobs.content
    assert len(tokens) >= 1 and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)

    shaped = api.chat.completions.create(
        model=str(model), messages=[{"role": "user", "content": "A record, please."}], temperature=1.0, seed=5,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}})
    jsonschema.validate(json.loads(shaped.choices[0].message.content), RECORD)


def test_anthropic_streamed_tool_round_trip(entry: NodeProcess, model: Path) -> None:
    api, case = anthropic_case.client(entry), anthropic_case
    with api.messages.stream(model=model.name, max_tokens=200, messages=case.ASK, tools=case.TOOLS,
                             tool_choice=case.FORCE_WEATHER) as stream:
        first = stream.get_final_message()
    case.check_calls(first, {"get_weather"})
    results = [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"} for call in case.tool_uses(first)]
    with api.messages.stream(model=model.name, max_tokens=8, tools=case.TOOLS,
                             messages=[*case.ASK, first.to_param(), {"role": "user", "content": results}]) as stream:
        second = stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # (Anthropic counts the prompt's tokens read from the cache apart from input_tokens.)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens + 10


def test_responses_streamed_function_call_round_trip(entry: NodeProcess, model: Path) -> None:
    api, case = responses_case.client(entry), responses_case
    with api.responses.stream(model=str(model), input=case.ASK, tools=case.TOOLS, max_output_tokens=300,
                              tool_choice=case.FORCE_WEATHER, parallel_tool_calls=False) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    call = first.output[0]
    case.check_call(call.name, call.arguments)
    conversation = [*case.ASK, *(item.model_dump(exclude_none=True) for item in first.output),
                    {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    with api.responses.stream(model=str(model), input=conversation, tools=case.TOOLS, tool_choice="none",
                              max_output_tokens=8, temperature=0.0) as stream:
        events = list(stream)
    assert events[-1].type in ("response.completed", "response.incomplete") and events[-1].response.output_text
    assert events[-1].response.usage.input_tokens > first.usage.input_tokens + 10


def test_ollama_chat_generate_and_the_model_endpoints(entry: NodeProcess, model: Path) -> None:
    api = ollama_case.client(entry)
    assert [listed.model for listed in api.list().models][0] == model.name  # the served model first, by its id
    assert api.show(str(model)).capabilities == ["completion", "tools"]
    assert [running.model for running in api.ps().models] == [model.name]
    generated = api.generate(model=str(model), prompt="Hello", options=ollama_case.GREEDY)
    assert generated.done and generated.response
    lines = list(api.chat(model=str(model), messages=ollama_case.ASK, options=ollama_case.GREEDY, stream=True))
    assert lines[-1].done and "".join(line.message.content for line in lines)
    streamed = api.chat(model=str(model), messages=[{"role": "user", "content": "A record, please."}], format=RECORD,
                        stream=True, options={"temperature": 1, "seed": 5, "num_predict": 200})
    jsonschema.validate(json.loads("".join(line.message.content for line in streamed)), RECORD)
