"""Malformed requests get a 4xx with an OpenAI error body, never a 5xx, and the node keeps serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.api_server import NodeProcess, checkpoint, node  # noqa: F401  (fixtures)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello!"}]
CONTEXT_LENGTH = 4096  # the test checkpoint's max_position_embeddings


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "MODEL", "messages": MESSAGES, "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "MODEL", "prompt": "Hello", "max_tokens": 4, **fields}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


JSON = {"Content-Type": "application/json"}

# (id, method, path, body: dict -> JSON-encoded | bytes as is | None, headers, status, param)
CASES: list[tuple[str, str, str, Any, dict[str, str], int, str | None]] = [
    ("truncated json", "POST", CHAT, b'{"model": "MODEL", "messages": [', JSON, 400, None),
    ("empty body", "POST", CHAT, b"", JSON, 400, None),
    ("body is an array", "POST", CHAT, b"[]", JSON, 400, None),
    ("body is a string", "POST", CHAT, b'"hello"', JSON, 400, None),
    ("body is null", "POST", CHAT, b"null", JSON, 400, None),
    ("NaN is not json", "POST", CHAT, b'{"model": "MODEL", "messages": [], "temperature": NaN}', JSON, 400, None),
    ("invalid utf-8", "POST", CHAT, b'{"model": "\xff\xfe\xfa"}', JSON, 400, None),
    ("deeply nested json", "POST", CHAT, b"[" * 100_000 + b"]" * 100_000, JSON, 400, None),
    ("text/plain, not json", "POST", CHAT, b"hello there", {"Content-Type": "text/plain"}, 400, None),
    ("form encoded", "POST", CHAT, b"model=MODEL&prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"},
     400, None),
    ("missing model", "POST", CHAT, without(chat(), "model"), JSON, 400, "model"),
    ("model is a number", "POST", CHAT, chat(model=123), JSON, 400, "model"),
    ("unknown model", "POST", CHAT, chat(model="gpt-9"), JSON, 404, "model"),
    ("missing messages", "POST", CHAT, without(chat(), "messages"), JSON, 400, "messages"),
    ("messages is a string", "POST", CHAT, chat(messages="hi"), JSON, 400, "messages"),
    ("empty messages", "POST", CHAT, chat(messages=[]), JSON, 400, "messages"),
    ("message is a string", "POST", CHAT, chat(messages=["hi"]), JSON, 400, "messages[0]"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), JSON, 400,
     "messages[0].role"),
    ("missing role", "POST", CHAT, chat(messages=[{"content": "x"}]), JSON, 400, "messages[0].role"),
    ("a tool message without its call", "POST", CHAT,
     chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), JSON, 400, "messages[0].tool_call_id"),
    ("a tool message without tool_call_id", "POST", CHAT, chat(messages=[
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "x"}]), JSON, 400, "messages[1].tool_call_id"),
    ("tool call arguments not JSON", "POST", CHAT, chat(messages=[
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                              "function": {"name": "f", "arguments": "{oops"}}]}]), JSON, 400,
     "messages[0].tool_calls[0].function.arguments"),
    ("missing content", "POST", CHAT, chat(messages=[{"role": "user"}]), JSON, 400, "messages[0].content"),
    ("content is a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), JSON, 400,
     "messages[0].content"),
    ("image content part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     JSON, 400, "messages[0].content[0].type"),
    ("text part without text", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     JSON, 400, "messages[0].content[0].text"),
    # Lone surrogates (JSON "\ud800" escapes) are no text a tokenizer takes; found by tests/api/test_fuzz_api.py.
    ("lone surrogate in content", "POST", CHAT, chat(messages=[{"role": "user", "content": "\ud800 hi"}]), JSON, 400,
     "messages[0].content"),
    ("lone surrogate in a text part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x\udfff"}]}]), JSON, 400,
     "messages[0].content[0].text"),
    ("lone surrogate in name", "POST", CHAT, chat(messages=[{"role": "user", "content": "x", "name": "\udc80"}]),
     JSON, 400, "messages[0].name"),
    ("lone surrogate in the prompt", "POST", COMPLETIONS, completion(prompt=["\ud83d"]), JSON, 400, "prompt"),
    ("name is a number", "POST", CHAT, chat(messages=[{"role": "user", "content": "x", "name": 3}]), JSON, 400,
     "messages[0].name"),
    ("assistant tool calls", "POST", CHAT,
     chat(messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]), JSON, 400,
     "messages[0].tool_calls[0]"),
    ("max_tokens is a boolean", "POST", CHAT, chat(max_tokens=True), JSON, 400, "max_tokens"),
    ("max_tokens is a string", "POST", CHAT, chat(max_tokens="10"), JSON, 400, "max_tokens"),
    ("max_tokens is a float", "POST", CHAT, chat(max_tokens=1.5), JSON, 400, "max_tokens"),
    ("max_tokens is zero", "POST", CHAT, chat(max_tokens=0), JSON, 400, "max_tokens"),
    ("max_tokens is negative", "POST", CHAT, chat(max_tokens=-5), JSON, 400, "max_tokens"),
    ("max_completion_tokens is a boolean", "POST", CHAT, chat(max_completion_tokens=False), JSON, 400,
     "max_completion_tokens"),
    ("temperature above 2", "POST", CHAT, chat(temperature=2.5), JSON, 400, "temperature"),
    ("temperature negative", "POST", CHAT, chat(temperature=-0.1), JSON, 400, "temperature"),
    ("temperature is a string", "POST", CHAT, chat(temperature="hot"), JSON, 400, "temperature"),
    ("temperature is a boolean", "POST", CHAT, chat(temperature=True), JSON, 400, "temperature"),
    ("top_p zero", "POST", CHAT, chat(top_p=0), JSON, 400, "top_p"),
    ("top_p above 1", "POST", CHAT, chat(top_p=1.5), JSON, 400, "top_p"),
    ("top_k negative", "POST", CHAT, chat(top_k=-1), JSON, 400, "top_k"),
    ("top_k is a float", "POST", CHAT, chat(top_k=2.5), JSON, 400, "top_k"),
    ("seed is a string", "POST", CHAT, chat(seed="abc"), JSON, 400, "seed"),
    ("seed is a float", "POST", CHAT, chat(seed=1.5), JSON, 400, "seed"),
    ("seed beyond 64 bits", "POST", CHAT, chat(seed=2**70), JSON, 400, "seed"),
    ("five stop strings", "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), JSON, 400, "stop"),
    ("empty stop string", "POST", CHAT, chat(stop=[""]), JSON, 400, "stop"),
    ("stop is a number", "POST", CHAT, chat(stop=123), JSON, 400, "stop"),
    ("stop list with a number", "POST", CHAT, chat(stop=["a", 1]), JSON, 400, "stop"),
    ("stream is a string", "POST", CHAT, chat(stream="yes"), JSON, 400, "stream"),
    ("stream_options without stream", "POST", CHAT, chat(stream_options={"include_usage": True}), JSON, 400,
     "stream_options"),
    ("stream_options is a list", "POST", CHAT, chat(stream=True, stream_options=[]), JSON, 400, "stream_options"),
    ("include_usage is a string", "POST", CHAT, chat(stream=True, stream_options={"include_usage": "yes"}), JSON,
     400, "stream_options.include_usage"),
    ("n beyond 16", "POST", CHAT, chat(n=17), JSON, 400, "n"),
    ("n is 0", "POST", CHAT, chat(n=0), JSON, 400, "n"),
    ("presence_penalty beyond 2", "POST", CHAT, chat(presence_penalty=2.5), JSON, 400, "presence_penalty"),
    ("frequency_penalty is a string", "POST", CHAT, chat(frequency_penalty="x"), JSON, 400, "frequency_penalty"),
    ("repetition_penalty 0", "POST", CHAT, chat(repetition_penalty=0), JSON, 400, "repetition_penalty"),
    ("min_p beyond 1", "POST", CHAT, chat(min_p=1.5), JSON, 400, "min_p"),
    ("logit_bias is a list", "POST", CHAT, chat(logit_bias=[1]), JSON, 400, "logit_bias"),
    ("logit_bias key not a token id", "POST", CHAT, chat(logit_bias={"hello": 1}), JSON, 400, "logit_bias"),
    ("logit_bias beyond 100", "POST", CHAT, chat(logit_bias={"5": 101}), JSON, 400, "logit_bias"),
    ("logit_bias key of 5000 digits", "POST", CHAT, chat(logit_bias={"1" * 5000: 1}), JSON, 400, "logit_bias"),
    ("logit_bias token outside the vocabulary", "POST", CHAT, chat(logit_bias={"99999999": 1}), JSON, 400,
     "logit_bias"),
    ("logprobs is a number (chat)", "POST", CHAT, chat(logprobs=3), JSON, 400, "logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), JSON, 400, "top_logprobs"),
    ("top_logprobs beyond 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), JSON, 400, "top_logprobs"),
    ("completion logprobs is a boolean", "POST", COMPLETIONS, completion(logprobs=True), JSON, 400, "logprobs"),
    ("a forced tool call with a response format", "POST", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}), JSON, 400, "tool_choice"),
    ("unknown tool in tool_choice", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                       tool_choice={"type": "function", "function": {"name": "g"}}),
     JSON, 400, "tool_choice"),
    ("tool_choice required without tools", "POST", CHAT, chat(tool_choice="required"), JSON, 400, "tool_choice"),
    ("tool name with a space", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), JSON,
     400, "tools[0].function.name"),
    ("tool parameters not a schema", "POST", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), JSON, 400,
     "tools[0].function.parameters"),
    ("response_format of an unknown type", "POST", CHAT, chat(response_format={"type": "yaml"}), JSON, 400,
     "response_format.type"),
    ("response_format schema that does not compile", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}), JSON,
     400, "response_format"),
    ("prompt longer than the context", "POST", CHAT,
     chat(messages=[{"role": "user", "content": "hello " * (CONTEXT_LENGTH + 100)}]), JSON, 400, "messages"),
    ("prompt plus max_tokens beyond the context", "POST", CHAT, chat(max_tokens=CONTEXT_LENGTH), JSON, 400,
     "max_tokens"),
    ("completion without prompt", "POST", COMPLETIONS, without(completion(), "prompt"), JSON, 400, "prompt"),
    ("prompt is a number", "POST", COMPLETIONS, completion(prompt=5), JSON, 400, "prompt"),
    ("batched prompts", "POST", COMPLETIONS, completion(prompt=["a", "b"]), JSON, 400, "prompt"),
    ("empty token prompt", "POST", COMPLETIONS, completion(prompt=[]), JSON, 400, "prompt"),
    ("token id out of the vocabulary", "POST", COMPLETIONS, completion(prompt=[1, 99999]), JSON, 400, "prompt"),
    ("token ids with a boolean", "POST", COMPLETIONS, completion(prompt=[1, True]), JSON, 400, "prompt"),
    ("completion prompt too long", "POST", COMPLETIONS, completion(prompt="hello " * (CONTEXT_LENGTH + 100)), JSON,
     400, "prompt"),
    ("echo", "POST", COMPLETIONS, completion(echo=True), JSON, 400, "echo"),
    ("best_of", "POST", COMPLETIONS, completion(best_of=2), JSON, 400, "best_of"),
    ("suffix", "POST", COMPLETIONS, completion(suffix="tail"), JSON, 400, "suffix"),
    ("completion unknown model", "POST", COMPLETIONS, completion(model="nope"), JSON, 404, "model"),
    ("unknown route", "POST", "/v1/embeddings", {"model": "MODEL", "input": "x"}, JSON, 404, None),
    ("unknown model id", "GET", "/v1/models/nope", None, {}, 404, "model"),
    # Found by tests/api/test_fuzz_api.py: the asset handler took both to the file system, which raised.
    ("NUL in an asset name", "GET", "/dashboard/app%00.js", None, {}, 404, None),
    ("asset name too long for a file name", "GET", "/dashboard/" + "a" * 300, None, {}, 404, None),
    ("GET on chat", "GET", CHAT, None, {}, 405, None),
    ("DELETE on models", "DELETE", "/v1/models", None, {}, 405, None),
    ("PUT on completions", "PUT", COMPLETIONS, completion(), JSON, 405, None),
]


def send(node: NodeProcess, model_id: str, method: str, path: str, body: Any,  # noqa: F811
         headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    if isinstance(body, dict):
        body = json.dumps(body).replace('"MODEL"', json.dumps(model_id)).encode()
    return node.request(method, path, body, headers)


def assert_error_body(raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


@pytest.fixture(scope="module")
def model_id(checkpoint: Path) -> str:  # noqa: F811
    return checkpoint.name


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "param"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_request_gets_an_openai_error(node: NodeProcess, model_id: str, method: str, path: str,  # noqa: F811
                                          body: Any, headers: dict[str, str], status: int, param: str | None) -> None:
    got, response_headers, raw = send(node, model_id, method, path, body, headers)
    assert got == status, raw
    assert response_headers["Content-Type"].startswith("application/json")
    error = assert_error_body(raw)
    assert error["param"] == param


def test_there_are_at_least_30_distinct_cases() -> None:
    assert len({case[0] for case in CASES}) == len(CASES) >= 30


def test_context_errors_say_the_numbers(node: NodeProcess, model_id: str) -> None:  # noqa: F811
    body = chat(messages=[{"role": "user", "content": "hello " * (CONTEXT_LENGTH + 100)}])
    status, _, raw = send(node, model_id, "POST", CHAT, body, JSON)
    error = assert_error_body(raw)
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert str(CONTEXT_LENGTH) in error["message"]
    status, _, raw = send(node, model_id, "POST", CHAT, chat(max_tokens=CONTEXT_LENGTH), JSON)
    message = assert_error_body(raw)["message"]
    assert str(CONTEXT_LENGTH) in message and f"{CONTEXT_LENGTH} for the completion" in message


def test_method_not_allowed_lists_allowed_methods(node: NodeProcess) -> None:  # noqa: F811
    status, headers, _ = node.request("GET", CHAT)
    assert status == 405 and "POST" in headers["Allow"]


def test_oversized_body_is_413(node: NodeProcess) -> None:  # noqa: F811
    status, _, raw = node.request("POST", CHAT, b" " * (33 * 1024 * 1024), JSON)
    assert status == 413
    assert_error_body(raw)


def test_a_path_cannot_forge_log_lines(node: NodeProcess) -> None:  # noqa: F811
    """Found by tests/api/test_fuzz_api.py: the log showed a model id's path decoded, control characters and all."""
    path = "/v1/models/x%0D2026-01-01%2000:00:00,000%20ERROR%20forged%00"
    status, _, raw = node.request("GET", path)
    assert status == 404
    assert assert_error_body(raw)["param"] == "model"
    lines = node.log().splitlines()
    assert not any(line.startswith("2026-01-01 00:00:00,000 ERROR") for line in lines)
    assert any(path in line for line in lines) and "\x00" not in node.log()


def test_a_request_the_http_parser_rejects_is_one_warning(node: NodeProcess) -> None:  # noqa: F811
    """Found by tests/api/test_fuzz_api.py: aiohttp logged such a request as an ERROR with a traceback."""
    status, _, raw = node.request("CONNECT", "/health?a[b]=1")  # CONNECT takes host:port, not a path
    assert status == 400, raw
    lines = [line for line in node.log().splitlines() if "malformed HTTP request" in line]
    assert lines and " WARNING " in lines[-1] and lines[-1].endswith("answered 400: /health?a[b]=1"), lines
    assert "Traceback" not in node.log()


def test_json_with_another_content_type_is_accepted(node: NodeProcess, model_id: str) -> None:  # noqa: F811
    """curl -d sends form encoding unless told otherwise; a JSON body is still understood."""
    body = json.dumps(chat(model=model_id)).encode()
    status, _, raw = node.request("POST", CHAT, body, {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["message"]["role"] == "assistant"


def test_harmless_unknown_fields_are_ignored(node: NodeProcess, model_id: str) -> None:  # noqa: F811
    body = chat(model=model_id, user="me", presence_penalty=0, frequency_penalty=0.0, logprobs=False, n=1,
                metadata={"a": "b"}, store=False, tool_choice="none", something_new={"x": 1})
    status, _, raw = send(node, model_id, "POST", CHAT, body, JSON)
    assert status == 200, raw


def test_node_still_serves_after_bad_requests(node: NodeProcess, model_id: str) -> None:  # noqa: F811
    for case in CASES:
        send(node, model_id, *case[1:5])
    status, _, raw = send(node, model_id, "POST", CHAT, chat(model=model_id, temperature=0), JSON)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 4
    health = node.get_json("/health")
    assert health["status"] == "ok"
    assert (health["in_flight_requests"], health["active_kv_caches"]) == (0, 0)
    assert "Traceback" not in node.log() and " 500 " not in node.log()
