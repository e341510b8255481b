"""Structured output through the HTTP API with the official `openai` client: 200 generated JSON schemas, a
random-weights model sampling at temperature 1, eight requests at a time: every answer parses and validates. (The
model keeps transformers' initial weights: it samples nearly at random among the allowed tokens. The peaky test
checkpoints fall into loops, e.g. a number's digits forever, which no grammar of the schema may forbid.)
json_object mode gives a JSON object; schemas the engine cannot enforce are a 400 naming response_format."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import jsonschema
import pytest

from tests.api_server import NodeProcess, start_node, tools_checkpoint, tools_node  # noqa: F401  (fixtures)
from tests.checkpoints import make_checkpoint
from tests.json_schemas import random_schema

if TYPE_CHECKING:
    import openai

SCHEMAS = 200
MAX_TOKENS = 1024


def client(server: NodeProcess):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def answer(api: openai.OpenAI, model: str, schema: dict, seed: int) -> tuple[str, str]:
    reply = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a thing as JSON."}], temperature=1.0, seed=seed,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}})
    return reply.choices[0].message.content, reply.choices[0].finish_reason


@pytest.fixture(scope="module")
def random_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, Path]]:
    model = make_checkpoint(tmp_path_factory.mktemp("flat") / "model", "qwen2", n_layers=2, peaky=False)
    # A lone node: no mDNS (starting it costs a second), placed by memory (no timing of a layer before it plans).
    process = start_node(tmp_path_factory.mktemp("home"), str(model), "--dtype", "float32", "--no-mdns",
                         "--placement", "memory")
    yield process, model
    assert process.stop() == 0, process.log()


@pytest.mark.slow
def test_two_hundred_schemas_at_temperature_one_always_parse_and_validate(
        random_node: tuple[NodeProcess, Path]) -> None:
    server, model = random_node
    rng = random.Random(2026)
    schemas = [random_schema(rng) for _ in range(SCHEMAS)]
    # One client for all the requests (it is thread-safe): making an OpenAI client takes tens of milliseconds of
    # this process's time (its HTTP client and TLS context), which 200 of them would spend instead of the node.
    api = client(server)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: answer(api, str(model), schemas[i], i), range(SCHEMAS)))
    for schema, (text, finish) in zip(schemas, replies):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_a_streamed_json_object_is_an_object(tools_node: NodeProcess, tools_checkpoint: Path) -> None:  # noqa: F811
    stream = client(tools_node).chat.completions.create(
        model=str(tools_checkpoint), messages=[{"role": "user", "content": "JSON please"}], temperature=0.0,
        stream=True, max_tokens=64, response_format={"type": "json_object"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:  # greedy on random weights may fill a string forever: what was sent is still an object's beginning
        assert finish == ["length"] and text.startswith("{")


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(("}}}}}, "unclosed"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema"),
    ({"type": "xml"}, "type"),
    ("json", "object"),
])
def test_schemas_that_cannot_be_enforced_are_a_400(tools_node: NodeProcess, tools_checkpoint: Path,  # noqa: F811
                                                   response_format: object, words: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        client(tools_node).chat.completions.create(model=str(tools_checkpoint), max_tokens=4,
                                                   messages=[{"role": "user", "content": "hi"}],
                                                   response_format=response_format)
    error = raised.value.body
    assert error["param"].startswith("response_format") and words in error["message"]
