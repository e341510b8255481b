"""Every bounded request field at its inclusive limits, in every dialect: the least and the greatest value a field
takes are accepted (and, where the reply can show it, honoured: 16 choices, 20 alternatives per token), and the
value one past each limit is refused with a 400 in the dialect's own error shape, naming the field.

Fields were found by reading exo_like/api/: fields.optional_int / optional_float and their Ollama twins
(ollama_models.integer / number), the list limits (stop strings, logit_bias entries, tools), the lengths of names
(a JSON schema's, a tool's), and the limits set by the model (a token id below the vocabulary's size, the prompt
plus max_tokens within the context). One past a float limit is the next double (math.nextafter); an exclusive
limit (top_p, repetition_penalty: greater than 0) is itself the value refused, the least double above it the value
accepted. The node is the dialect tests' shared one (tests/api_server.py: tools_node), asked over HTTP."""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from exo_like.api.ollama_api import MAX_STOP_STRINGS as OLLAMA_MAX_STOP_STRINGS
from exo_like.api.ollama_api import MAX_TOP_LOGPROBS as OLLAMA_MAX_TOP_LOGPROBS
from exo_like.api.openai_requests import MAX_LOGIT_BIAS, MAX_N, MAX_TOP_LOGPROBS
from exo_like.api.requests import MAX_STOP_STRINGS
from exo_like.api.tool_requests import MAX_TOOLS
from tests.api.fuzz_dialects import anthropic_error, ollama_error, openai_error
from tests.api_server import NodeProcess, tools_checkpoint, tools_node  # noqa: F401  (fixtures)

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1  # a seed's range: OpenAI's signed 64 bits and the unsigned ones
TINY = 5e-324  # the least positive double: what "greater than 0" accepts first


def above(x: float) -> float:
    return math.nextafter(x, math.inf)


def below(x: float) -> float:
    return math.nextafter(x, -math.inf)


@dataclass(frozen=True)
class Model:
    """What the checkpoint sets (the context the prompt and the completion share, the token ids it has) and the
    prompts of the dialects' base requests, counted by the node (for the context's limit on max_tokens)."""

    name: str
    context: int
    prompt_vocab: int  # prompt token ids are the tokenizer's
    bias_vocab: int  # logit_bias ids must also have a logit: the smaller of the tokenizer's and the model's
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # by dialect path

    def room(self, path: str) -> int:
        """The most tokens the base request of the dialect at `path` may ask for."""
        return self.context - self.prompt_tokens[path]


@pytest.fixture(scope="module")
def model(tools_node: NodeProcess, tools_checkpoint: Path) -> Model:  # noqa: F811
    from tokenizers import Tokenizer

    config = json.loads((tools_checkpoint / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(tools_checkpoint / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    known = Model(str(tools_checkpoint), config["max_position_embeddings"], tokenizer,
                  min(tokenizer, config["vocab_size"]))
    for dialect, usage in ((CHAT, "prompt_tokens"), (COMPLETIONS, "prompt_tokens"), (RESPONSES, "input_tokens")):
        status, reply = send(tools_node, dialect.path, dialect.base(known))
        assert status == 200, reply
        known.prompt_tokens[dialect.path] = reply["usage"][usage]
    return known


# -- the requests -------------------------------------------------------------------------------------------------


def send(node: NodeProcess, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, raw = node.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(raw)


def opens(node: NodeProcess, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """A streamed request's status and its first line; the connection is then closed (the node stops the
    generation), so a request that may generate to the end of the context costs a token or so."""
    connection = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        first = response.readline() if response.status == 200 else response.read()
        return response.status, first
    finally:
        connection.close()


def with_value(body: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    """`body` with the (dotted) field `name` set to `value`."""
    body = json.loads(json.dumps(body))
    *outer, key = name.split(".")
    parent = body
    for part in outer:
        parent = parent.setdefault(part, {})
    parent[key] = value
    return body


@dataclass(frozen=True)
class Dialect:
    path: str
    base: Callable[[Model], dict[str, Any]]  # a valid request for one token
    refused: Callable[[int, Any, str], None]  # asserts a refusal naming the field, in the dialect's shape


def openai_refusal(status: int, body: Any, param: str) -> None:
    assert status == 400, body
    openai_error(body)
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param, body


def anthropic_refusal(status: int, body: Any, param: str) -> None:
    assert status == 400, body
    anthropic_error(body)
    assert body["error"]["type"] == "invalid_request_error" and param in body["error"]["message"], body


def ollama_refusal(status: int, body: Any, param: str) -> None:
    assert status == 400, body
    ollama_error(body)
    assert param in body["error"], body


HI = [{"role": "user", "content": "Hi"}]
CHAT = Dialect("/v1/chat/completions", lambda m: {"model": m.name, "messages": HI, "max_tokens": 1},
               openai_refusal)
COMPLETIONS = Dialect("/v1/completions", lambda m: {"model": m.name, "prompt": "Hi", "max_tokens": 1},
                      openai_refusal)
RESPONSES = Dialect("/v1/responses", lambda m: {"model": m.name, "input": "Hi", "max_output_tokens": 1},
                    openai_refusal)
ANTHROPIC = Dialect("/v1/messages", lambda m: {"model": m.name, "messages": HI, "max_tokens": 1},
                    anthropic_refusal)
OLLAMA_CHAT = Dialect("/api/chat", lambda m: {"model": m.name, "messages": HI, "stream": False,
                                              "options": {"num_predict": 1}}, ollama_refusal)
OLLAMA_GENERATE = Dialect("/api/generate", lambda m: {"model": m.name, "prompt": "Hi", "stream": False,
                                                      "options": {"num_predict": 1}}, ollama_refusal)


@dataclass(frozen=True)
class Limit:
    """A field's least and greatest accepted values (None: unbounded that way) and the values one past each.
    Values may be functions of the model (its context, its vocabulary)."""

    name: str  # dotted: "options.temperature"
    least: Any
    greatest: Any
    below_least: Any = None
    above_greatest: Any = None
    param: str | None = None  # the field as the error names it, if not `name`
    param_past_greatest: str | None = None  # ... and past the greatest value, if not `param`
    also: dict[str, Any] = field(default_factory=dict)  # other fields the value needs (logprobs for top_logprobs)
    to_the_end: bool = False  # the value may generate to the end of the context: streamed, only its head read
    shows: Callable[[Any, Any], None] | None = None  # (reply, value): asserts the reply honours the value
    # (status, reply) of the greatest value: asserts the field was accepted, where the request cannot be served for
    # another reason (None: a 200)
    greatest_accepted: Callable[[int, Any], None] | None = None

    def __post_init__(self) -> None:
        # Each bound given has the value one past it, and the other way round.
        assert (self.least is None) == (self.below_least is None) or self.name in UNBOUNDED_BELOW, self
        assert (self.greatest is None) == (self.above_greatest is None), self


UNBOUNDED_BELOW = ("logit_bias", "stop", "tools", "stop_sequences", "options.stop")  # lists: empty is no limit


def check_limit(node: NodeProcess, model: Model, dialect: Dialect, limit: Limit) -> None:
    def resolved(value: Any) -> Any:
        return value(model) if callable(value) else value

    base = {**dialect.base(model), **limit.also}
    for value in (limit.least, limit.greatest):
        if value is None:
            continue
        body = with_value(base, limit.name, resolved(value))
        if limit.to_the_end:
            status, head = opens(node, dialect.path, {**body, "stream": True})
            assert status == 200 and head.strip(), (limit.name, resolved(value), head)
            continue
        status, reply = send(node, dialect.path, body)
        if value is limit.greatest and limit.greatest_accepted is not None:
            limit.greatest_accepted(status, reply)
            continue
        assert status == 200, (limit.name, resolved(value), reply)
        if limit.shows is not None:
            limit.shows(reply, resolved(value))
    param = limit.param or limit.name
    for value, named in ((limit.below_least, param), (limit.above_greatest, limit.param_past_greatest or param)):
        if value is None:
            continue
        status, reply = send(node, dialect.path, with_value(base, limit.name, resolved(value)))
        dialect.refused(status, reply, named)


# -- what the replies show ----------------------------------------------------------------------------------------


def n_choices(reply: Any, n: int) -> None:
    assert [choice["index"] for choice in reply["choices"]] == list(range(n)), reply


def chat_alternatives(reply: Any, top: int) -> None:
    tokens = reply["choices"][0]["logprobs"]["content"]
    assert tokens and all(len(token["top_logprobs"]) == top for token in tokens), reply


def completion_alternatives(reply: Any, top: int) -> None:
    logprobs = reply["choices"][0]["logprobs"]
    assert logprobs["tokens"] and len(logprobs["token_logprobs"]) == len(logprobs["tokens"]), reply
    assert all(len(alternatives or {}) == top for alternatives in logprobs["top_logprobs"]), reply


def ollama_alternatives(reply: Any, top: int) -> None:
    tokens = reply["logprobs"]
    assert tokens and all(len(token["top_logprobs"]) == top for token in tokens), reply


# -- the limits ---------------------------------------------------------------------------------------------------


def stops(count: int) -> list[str]:
    return [f"stop{i}" for i in range(count)]


def bias(entries: int) -> dict[str, float]:
    return {str(token): 1.0 for token in range(entries)}


def schema_named(length: int) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "n" * length, "schema": {"type": "object"}}}


def tools(make: Callable[[str], dict[str, Any]], count: int) -> list[dict[str, Any]]:
    return [make(f"t{i}") for i in range(count)]


def openai_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def responses_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name}


def anthropic_tool(name: str) -> dict[str, Any]:
    return {"name": name, "input_schema": {"type": "object"}}


def past_the_context(status: int, reply: Any) -> None:
    """The request was refused for its prompt's length alone: its fields passed (the most tools a request may
    offer make a prompt longer than the test checkpoint's context of 4096 tokens, whatever the tools say)."""
    assert status == 400, reply
    message = reply["error"] if isinstance(reply["error"], str) else reply["error"]["message"]
    assert "maximum context length is" in message and "the prompt has" in message, reply
    if "code" in reply["error"]:  # OpenAI's shape: the prompt is named, not the tools
        assert reply["error"]["code"] == "context_length_exceeded", reply
        assert reply["error"]["param"] in ("messages", "input"), reply


def tool_limits(make: Callable[[str], dict[str, Any]], name_param: str) -> list[Limit]:
    """How many tools a request may offer, and how long a tool's name may be (1 to 64 characters)."""
    return [Limit("tools", tools(make, 1), tools(make, MAX_TOOLS), None, tools(make, MAX_TOOLS + 1),
                  greatest_accepted=past_the_context),
            Limit("tools", [make("t")], [make("t" * 64)], [make("")], [make("t" * 65)], param=name_param)]


# OpenAI's sampling and choice fields, shared by chat and completions (openai_requests._options, _sampling).
OPENAI_SHARED = [
    Limit("temperature", 0, 2, below(0), above(2)),
    Limit("top_p", TINY, 1, 0, above(1)),
    Limit("top_k", 0, None, -1),
    Limit("seed", INT64_MIN, UINT64_MAX, INT64_MIN - 1, UINT64_MAX + 1),
    Limit("min_p", 0, 1, below(0), above(1)),
    Limit("presence_penalty", -2, 2, below(-2), above(2)),
    Limit("frequency_penalty", -2, 2, below(-2), above(2)),
    Limit("repetition_penalty", TINY, 100, 0, above(100)),
    Limit("logit_bias.0", -100, 100, below(-100), above(100), param="logit_bias"),
    Limit("logit_bias", bias(1), bias(MAX_LOGIT_BIAS), None, bias(MAX_LOGIT_BIAS + 1)),
    Limit("logit_bias", {"0": 1.0}, lambda m: {str(m.bias_vocab - 1): 1.0}, None, lambda m: {str(m.bias_vocab): 1.0}),
    Limit("n", 1, MAX_N, 0, MAX_N + 1, shows=n_choices),
    Limit("stop", stops(1), stops(MAX_STOP_STRINGS), None, stops(MAX_STOP_STRINGS + 1)),
    Limit("response_format", schema_named(1), schema_named(64), schema_named(0), schema_named(65),
          param="response_format.json_schema.name"),
]

LIMITS: dict[str, tuple[Dialect, list[Limit]]] = {
    "chat": (CHAT, [
        *OPENAI_SHARED,
        Limit("max_tokens", 1, lambda m: m.room(CHAT.path), 0, lambda m: m.room(CHAT.path) + 1, to_the_end=True),
        # (past the context, the error names max_tokens, the older name of the same limit)
        Limit("max_completion_tokens", 1, lambda m: m.room(CHAT.path), 0, lambda m: m.room(CHAT.path) + 1,
              to_the_end=True, param_past_greatest="max_tokens"),
        Limit("top_logprobs", 0, MAX_TOP_LOGPROBS, -1, MAX_TOP_LOGPROBS + 1, also={"logprobs": True},
              shows=chat_alternatives),
        *tool_limits(openai_tool, "tools[0].function.name"),
    ]),
    "completions": (COMPLETIONS, [
        *OPENAI_SHARED,
        Limit("max_tokens", 1, lambda m: m.room(COMPLETIONS.path), 0, lambda m: m.room(COMPLETIONS.path) + 1,
              to_the_end=True),
        # (tokens named by id: as text, two alternatives may read the same and share a key of top_logprobs)
        Limit("logprobs", 0, MAX_TOP_LOGPROBS, -1, MAX_TOP_LOGPROBS + 1, also={"return_tokens_as_token_ids": True},
              shows=completion_alternatives),
        Limit("prompt", [0], lambda m: [m.prompt_vocab - 1], [-1], lambda m: [m.prompt_vocab]),
    ]),
    "responses": (RESPONSES, [
        Limit("temperature", 0, 2, below(0), above(2)),
        Limit("top_p", TINY, 1, 0, above(1)),
        Limit("max_output_tokens", 1, lambda m: m.room(RESPONSES.path), 0, lambda m: m.room(RESPONSES.path) + 1,
              to_the_end=True),
        Limit("text", {"format": schema_named(1)["json_schema"] | {"type": "json_schema"}},
              {"format": schema_named(64)["json_schema"] | {"type": "json_schema"}},
              {"format": schema_named(0)["json_schema"] | {"type": "json_schema"}},
              {"format": schema_named(65)["json_schema"] | {"type": "json_schema"}}, param="text.format.name"),
        *tool_limits(responses_tool, "tools[0].name"),
    ]),
    "anthropic": (ANTHROPIC, [
        Limit("max_tokens", 1, None, 0),  # no greatest: more than the context holds is "to the end" here
        Limit("temperature", 0, 1, below(0), above(1)),
        Limit("top_p", TINY, 1, 0, above(1)),
        Limit("top_k", 0, None, -1),
        Limit("stop_sequences", stops(1), stops(MAX_STOP_STRINGS), None, stops(MAX_STOP_STRINGS + 1)),
        *tool_limits(anthropic_tool, "tools[0].name"),
    ]),
}


def ollama_limits(chat: bool) -> list[Limit]:
    """/api/chat's and /api/generate's options (ollama_api._options, _sampling), and /api/chat's tools."""
    return [
        Limit("options.temperature", 0, 100, below(0), above(100)),
        Limit("options.top_p", TINY, 1, 0, above(1)),
        Limit("options.repeat_penalty", TINY, 100, 0, above(100)),
        Limit("options.min_p", 0, 1, below(0), above(1)),
        Limit("options.presence_penalty", -2, 2, below(-2), above(2)),
        Limit("options.frequency_penalty", -2, 2, below(-2), above(2)),
        Limit("options.top_k", 0, 2**31, -1, 2**31 + 1),
        Limit("options.seed", INT64_MIN, UINT64_MAX, INT64_MIN - 1, UINT64_MAX + 1),
        Limit("options.num_predict", -2, 2**31, -3, 2**31 + 1, to_the_end=True),  # -2, -1, 0: to the end
        Limit("top_logprobs", 0, OLLAMA_MAX_TOP_LOGPROBS, -1, OLLAMA_MAX_TOP_LOGPROBS + 1, also={"logprobs": True},
              shows=ollama_alternatives),
        Limit("options.stop", stops(1), stops(OLLAMA_MAX_STOP_STRINGS), None, stops(OLLAMA_MAX_STOP_STRINGS + 1)),
        *(tool_limits(openai_tool, "tools[0].function.name") if chat else []),
    ]


LIMITS["ollama chat"] = (OLLAMA_CHAT, ollama_limits(chat=True))
LIMITS["ollama generate"] = (OLLAMA_GENERATE, ollama_limits(chat=False))
CASES = [(dialect, i) for dialect, (_, limits) in LIMITS.items() for i in range(len(limits))]


def case_id(case: tuple[str, int]) -> str:
    dialect, i = case
    limit = LIMITS[dialect][1][i]
    return f"{dialect}: {limit.param or limit.name}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(case) for case in CASES])
def test_a_field_takes_its_limits_and_refuses_one_past_them(tools_node: NodeProcess, model: Model,  # noqa: F811
                                                            case: tuple[str, int]) -> None:
    dialect, limits = LIMITS[case[0]]
    check_limit(tools_node, model, dialect, limits[case[1]])
