"""What agents use, through a 3-node ring of processes on this host (the last stage samples: masks, calls, logprobs
all happen there), asked at a node that is not the last stage, with the official clients: OpenAI tool calls
streamed and round-tripped, structured output, log-probabilities."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.api.test_tools_openai import ASK, SCHEMAS, TOOLS, check_call
from tests.api_server import NodeProcess, stop_nodes, tools_checkpoint  # noqa: F401  (fixture)
from tests.cluster_harness import start_cluster, wait_until_ready

RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tools_ring(tools_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:  # noqa: F811
    nodes = start_cluster(tmp_path_factory.mktemp("ring"), str(tools_checkpoint), [3, 2, 1])
    wait_until_ready(nodes, members=3)
    yield nodes
    stop_nodes(nodes)


def entry(nodes: list[NodeProcess]) -> NodeProcess:
    """A node that is not the plan's last stage: its requests' tokens come back over the ring."""
    plan = nodes[0].get_json("/v1/cluster")["plan"]
    last = plan["stages"][-1]["node_id"]
    return next(node for node in nodes if node.get_json("/health")["node_id"] != last)


def openai_client(node: NodeProcess):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_openai_tool_calls_structured_output_and_logprobs_on_a_ring(tools_ring: list[NodeProcess],
                                                                    tools_checkpoint: Path) -> None:  # noqa: F811
    api, model = openai_client(entry(tools_ring)), str(tools_checkpoint)
    stream = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
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
    answer = api.chat.completions.create(model=model, messages=conversation, tools=TOOLS, max_tokens=6,
                                         temperature=0.0, logprobs=True, top_logprobs=2)
    tokens = answer.choices[0].logprobs.content
    assert len(tokens) >= 1 and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)

    shaped = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A record, please."}], temperature=1.0, seed=5,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}})
    jsonschema.validate(json.loads(shaped.choices[0].message.content), RECORD)
