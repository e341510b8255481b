"""Ollama's native API through the official `ollama` client, on the tiny random checkpoint whose chat template renders
tools (Hermes / Qwen2.5 style): chat and generate, streamed (NDJSON, the default) or whole, through the chat template
or raw; the load call; the model endpoints (tags, show, ps, version); tools and a tool conversation reaching the
template; structured output; log-probabilities; and errors in Ollama's shape through the client's ResponseError. The
same through a 3-node ring at the end. The OpenAI twin of the tool tests is tests/api/test_tools_openai.py."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import ollama
import pytest

from exo_like.api.generation import Piece, TextGeneration
from exo_like.api.ollama_api import CallLinker, Replies
from exo_like.api.tool_calls import ToolCall
from exo_like.errors import InvalidRequestError
from tests.api.test_tools_openai import TOOLS
from tests.api_server import NodeProcess, stop_nodes, tools_checkpoint, tools_node  # noqa: F401  (fixtures)
from tests.chat_templates import HERMES_TOOLS_TEMPLATE

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 12}
RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}
CALLED = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
    {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]},
    {"role": "tool", "tool_name": "get_weather", "content": '{"temperature": 21}'}]


def client(node: NodeProcess) -> ollama.Client:
    return ollama.Client(host=node.base_url, timeout=120)


def post_json(node: NodeProcess, path: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    return node.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})


def ollama_error(call: Callable[[], object]) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as caught:
        result = call()
        if isinstance(result, Iterator):  # a stream fails on its first line
            list(result)
    return caught.value


def test_a_streamed_chat_joins_to_the_whole_answer(tools_node: NodeProcess,  # noqa: F811
                                                   tools_checkpoint: Path) -> None:  # noqa: F811
    api, model = client(tools_node), str(tools_checkpoint)
    whole = api.chat(model=model, messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.model == model and whole.created_at.endswith("Z") and whole.message.content
    assert whole.prompt_eval_count > 5 and 1 <= whole.eval_count <= 12
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0
    lines = list(api.chat(model=model, messages=ASK, options=GREEDY, stream=True))
    assert [line.done for line in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(line.message.content for line in lines) == whole.message.content
    assert lines[-1].message.content == "" and lines[-1].eval_count == whole.eval_count


def test_streaming_is_the_default_and_is_ndjson(tools_node: NodeProcess,  # noqa: F811
                                                tools_checkpoint: Path) -> None:  # noqa: F811
    status, headers, raw = post_json(tools_node, "/api/generate", {"model": str(tools_checkpoint),
                                                                   "prompt": "Hello", "options": GREEDY})
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert len(lines) > 1 and lines[-1]["done"] is True and "context" not in lines[-1]
    assert all(set(line) >= {"model", "created_at", "response", "done"} for line in lines)


def test_generate_goes_through_the_template_unless_raw(tools_node: NodeProcess,  # noqa: F811
                                                       tools_checkpoint: Path) -> None:  # noqa: F811
    api, model = client(tools_node), str(tools_checkpoint)
    templated = api.generate(model=model, prompt=ASK[0]["content"], options=GREEDY)
    chatted = api.chat(model=model, messages=ASK, options=GREEDY)
    assert templated.response == chatted.message.content
    assert templated.prompt_eval_count == chatted.prompt_eval_count
    with_system = api.generate(model=model, prompt=ASK[0]["content"], system="Be brief.", options=GREEDY)
    assert with_system.prompt_eval_count > templated.prompt_eval_count
    raw = api.generate(model=model, prompt=ASK[0]["content"], raw=True, options=GREEDY)
    assert raw.done and raw.prompt_eval_count < templated.prompt_eval_count
    streamed = list(api.generate(model=model, prompt=ASK[0]["content"], raw=True, options=GREEDY, stream=True))
    assert "".join(line.response for line in streamed) == raw.response


def test_num_predict_past_the_context_ends_at_the_context(tools_node: NodeProcess,  # noqa: F811
                                                         tools_checkpoint: Path) -> None:  # noqa: F811
    """A cap, never an error, as in Ollama: the prompt (BOS and two tokens a word) leaves 15 of the 4096."""
    reply = client(tools_node).generate(model=str(tools_checkpoint), prompt="hello " * 2040, raw=True,
                                        options={"temperature": 0, "num_predict": 100})
    assert (reply.prompt_eval_count, reply.eval_count, reply.done_reason) == (4081, 15, "length")


def test_a_request_without_prompt_or_messages_loads_the_model(tools_node: NodeProcess,  # noqa: F811
                                                               tools_checkpoint: Path) -> None:  # noqa: F811
    api, model = client(tools_node), str(tools_checkpoint)
    loaded = api.generate(model=model)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert api.chat(model=model, messages=[]).done_reason == "load"
    assert ollama_error(lambda: api.generate(model="no-such-model")).status_code == 404


def test_tags_show_and_ps_describe_the_served_model(tools_node: NodeProcess,  # noqa: F811
                                                    tools_checkpoint: Path) -> None:  # noqa: F811
    api = client(tools_node)
    served = api.list().models[0]
    assert served.model == tools_checkpoint.name and re.fullmatch(r"[0-9a-f]{64}", served.digest)
    assert served.size > 0 and served.modified_at is not None
    assert (served.details.format, served.details.family, served.details.quantization_level) == (
        "safetensors", "qwen2", "F32")
    assert served.details.parameter_size.endswith(("K", "M"))
    shown = api.show(str(tools_checkpoint))
    assert shown.capabilities == ["completion", "tools"] and shown.template == HERMES_TOOLS_TEMPLATE
    assert shown.modelinfo["general.architecture"] == "qwen2" and shown.modelinfo["qwen2.context_length"] == 4096
    assert shown.details == served.details
    running = api.ps().models
    assert [(m.model, m.digest, m.context_length) for m in running] == [(served.model, served.digest, 4096)]
    assert running[0].expires_at.year > 2100


def test_the_version_parses_as_clients_parse_it(tools_node: NodeProcess) -> None:  # noqa: F811
    version = tools_node.get_json("/api/version")["version"]
    # Open WebUI's parse (what follows "-" dropped); VS Code's Copilot wants 0.6.4 or later.
    assert tuple(map(int, re.sub(r"^v|-.*", "", version).split("."))) >= (0, 6, 4)


def test_tools_and_a_tool_conversation_reach_the_template(tools_node: NodeProcess,  # noqa: F811
                                                          tools_checkpoint: Path) -> None:  # noqa: F811
    api, model = client(tools_node), str(tools_checkpoint)
    plain = api.chat(model=model, messages=ASK, options=GREEDY)
    offered = api.chat(model=model, messages=ASK, tools=TOOLS, options=GREEDY)
    assert offered.prompt_eval_count > plain.prompt_eval_count + 50  # the tools' definitions
    answered = api.chat(model=model, messages=CALLED, tools=TOOLS, options=GREEDY)
    assert answered.done and answered.prompt_eval_count > offered.prompt_eval_count + 10  # the call and its result
    error = ollama_error(lambda: api.chat(model=model, messages=[*ASK, CALLED[-1]], options=GREEDY))
    assert error.status_code == 400 and "no unanswered tool call" in error.error


def test_a_tool_result_answers_the_latest_unanswered_call_of_its_name() -> None:
    calls = CallLinker()
    made = calls.made([{"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}],
                      "messages[1]")
    assert [call["id"] for call in made] == ["call_0", "call_1"]
    assert calls.answered("b", "messages[2]") == "call_1" and calls.answered(None, "messages[3]") == "call_0"
    calls.made([{"function": {"name": "a", "arguments": '{"x": 1}'}}], "messages[4]")
    with pytest.raises(InvalidRequestError):
        calls.answered("b", "messages[5]")


def test_a_tool_call_is_shaped_as_the_client_reads_it() -> None:
    """The random model never calls a tool by itself: the reply's shape, checked by the client's own types."""
    generation = TextGeneration(None, None, [1, 2, 3], None, 8, (),  # type: ignore[arg-type]
                                finish_reason="tool_calls", completion_tokens=5)
    call = ToolCall("get_weather", '{"city": "Paris", "unit": "C"}')
    replies = Replies(True, "m", time.monotonic())
    whole = ollama.ChatResponse(**replies.whole(Piece("", calls=(call,)), generation))
    assert whole.done_reason == "stop" and whole.prompt_eval_count == 3 and whole.eval_count == 5
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})]
    streamed = [ollama.ChatResponse(**line) for line in replies.lines(Piece("Sure.", calls=(call,)))]
    assert [(line.message.content, bool(line.message.tool_calls), line.done) for line in streamed] == [
        ("Sure.", False, False), ("", True, False)]


def test_format_holds_the_output_to_a_schema(tools_node: NodeProcess,  # noqa: F811
                                             tools_checkpoint: Path) -> None:  # noqa: F811
    api, model = client(tools_node), str(tools_checkpoint)
    ask = [{"role": "user", "content": "A record, please."}]
    for seed in range(3):
        reply = api.chat(model=model, messages=ask, format=RECORD, options={"temperature": 1, "seed": seed,
                                                                            "num_predict": 200})
        jsonschema.validate(json.loads(reply.message.content), RECORD)
    # "json": any object, which a random model need not close within a few tokens; it opens one.
    streamed = api.generate(model=model, prompt="Any JSON.", format="json", stream=True,
                            options={"temperature": 1, "seed": 7, "num_predict": 8})
    assert "".join(line.response for line in streamed).lstrip().startswith("{")


def test_log_probabilities_come_with_each_token(tools_node: NodeProcess,  # noqa: F811
                                                tools_checkpoint: Path) -> None:  # noqa: F811
    reply = client(tools_node).chat(model=str(tools_checkpoint), messages=ASK, logprobs=True, top_logprobs=2,
                                    options={"temperature": 0, "num_predict": 6})
    assert reply.logprobs and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in reply.logprobs)
    assert len(reply.logprobs) in (reply.eval_count, reply.eval_count - 1)  # an end-of-sequence token shows none


def test_errors_come_in_ollamas_shape(tools_node: NodeProcess, tools_checkpoint: Path) -> None:  # noqa: F811
    api, model = client(tools_node), str(tools_checkpoint)
    unknown = ollama_error(lambda: api.chat(model="no-such-model", messages=ASK, stream=True))
    assert unknown.status_code == 404 and unknown.error.startswith("model 'no-such-model' not found")
    assert ollama_error(lambda: api.show("no-such-model")).error == "model 'no-such-model' not found"
    image = [{"role": "user", "content": "What is this?", "images": [b"\x89PNG"]}]
    for call, words in ((lambda: api.chat(model=model, messages=image), "images"),
                        (lambda: api.chat(model=model, messages=ASK, think="deeply"), "think must be"),
                        (lambda: api.chat(model=model, messages=ASK, options={"temperature": "hot"}),
                         "options.temperature must be a number"),
                        (lambda: api.generate(model=model, prompt="x", options={"top_k": 1.5}), "options.top_k"),
                        (lambda: api.generate(model=model, prompt="x", suffix="y"), "suffix"),
                        (lambda: api.chat(model=model, messages=ASK, format={"type": "string", "pattern": "(("}),
                         "format")):
        error = ollama_error(call)
        assert error.status_code == 400 and words in error.error, error
    status, _, raw = post_json(tools_node, "/api/chat", {"model": model, "messages": ASK, "format": "xml"})
    assert status == 400 and json.loads(raw) == {"error": 'format must be "json" or a JSON schema object'}
    for method, path, status in (("POST", "/api/push", 404), ("GET", "/api/chat", 405)):
        got, _, raw = tools_node.request(method, path)
        assert got == status and set(json.loads(raw)) == {"error"}, raw
