"""What the API fuzz (test_fuzz_api.py) knows of each dialect's generation endpoints: a valid request, the fields to
break, how to keep a valid request short, its error shape and how its streams end."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

SMALL_MAX_TOKENS = 4
ODD_TEXT = st.sampled_from(["", "\x00", "\u202e", "\ufeff", "\U0010ffff", "😀" * 50, "\r\n", "%", "..", "ab" * 500,
                           "\ud800 hi", "x\udfff", "\udc80\ud800"])  # lone surrogates: JSON can escape them
TEXT = st.one_of(st.text(max_size=30), ODD_TEXT)
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
# Near-valid values of the structured fields, beside the generic JSON values every field gets.
SHAPED_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "tools": st.sampled_from([[TOOL], [TOOL, TOOL], [{"type": "function", "function": {"name": "a b"}}],
                              [{"name": "f", "input_schema": {"type": "object"}}], [{"type": "web_search"}]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", "any", {"type": "function", "function": {
        "name": "get_time"}}, {"type": "tool", "name": "nope"}, {"type": "function", "name": "get_time"}]),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "(("}}}, {"type": "json_schema"}]),
    "format": st.sampled_from(["json", SCHEMA, {"type": "nope"}, "yaml"]),
    "text": st.sampled_from([{"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
                             {"format": {"type": "json_object"}}, {"format": {"type": "xml"}}]),
}


@dataclass(frozen=True)
class Dialect:
    path: str
    valid: Callable[[str], st.SearchStrategy[dict[str, Any]]]  # model -> valid bodies
    fields: tuple[str, ...]  # top-level fields to break
    message_fields: tuple[str, ...]  # fields of messages[0] to break (empty: none)
    cap: Callable[[dict[str, Any]], dict[str, Any]]  # a body asking for at most SMALL_MAX_TOKENS tokens
    error: Callable[[Any], None]  # asserts an error body has the dialect's shape
    stream_ends: Callable[[bytes], None]  # asserts a streamed 200 body ends as the dialect ends streams


def openai_error(body: Any) -> None:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


def anthropic_error(body: Any) -> None:
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str), body


def ollama_error(body: Any) -> None:
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body


def sse_events(raw: bytes) -> list[tuple[str | None, bytes]]:
    """(event name or None, data) of each server-sent event."""
    events = []
    for block in raw.split(b"\n\n"):
        name, data = None, None
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[len(b"event: "):].decode()
            elif line.startswith(b"data: "):
                data = line[len(b"data: "):]
        if data is not None:
            events.append((name, data))
    return events


def openai_stream_ends(raw: bytes) -> None:
    """Every event is JSON and the last one is [DONE]; a chunk with an error is in the OpenAI shape."""
    events = [data for _, data in sse_events(raw)]
    assert events and events[-1] == b"[DONE]", raw
    for event in events[:-1]:
        payload = json.loads(event)
        if "error" in payload:
            openai_error(payload)
        else:
            assert payload["choices"] or "usage" in payload, payload


def responses_stream_ends(raw: bytes) -> None:
    events = sse_events(raw)
    assert events, raw
    for name, data in events:
        assert name == json.loads(data)["type"], (name, data)
    assert events[-1][0] in ("response.completed", "response.incomplete", "response.failed", "error"), raw


def anthropic_stream_ends(raw: bytes) -> None:
    events = sse_events(raw)
    assert events and events[0][0] == "message_start", raw
    for name, data in events:
        assert name == json.loads(data)["type"], (name, data)
    last_name, last = events[-1]
    if last_name == "error":
        anthropic_error(json.loads(last))
    else:
        assert last_name == "message_stop", raw


def ollama_stream_ends(raw: bytes) -> None:
    lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
    assert lines, raw
    if "error" in lines[-1]:
        ollama_error(lines[-1])
    else:
        assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1]), raw


def _capped(body: dict[str, Any], *names: str, add: bool = False) -> dict[str, Any]:
    """Each of `names` (a key, or "options.num_predict") at most SMALL_MAX_TOKENS where it is a positive int, and
    with `add`, set where missing (a missing limit there means: to the end of the context)."""
    body = dict(body)
    for name in names:
        *outer, key = name.split(".")
        parent = body
        if outer:
            inner = body.get(outer[0], {} if add else None)
            if not isinstance(inner, dict):
                continue
            parent = body[outer[0]] = dict(inner)
        value = parent.get(key)
        if value is None and add:
            parent[key] = SMALL_MAX_TOKENS
        elif isinstance(value, int) and not isinstance(value, bool) and (value > SMALL_MAX_TOKENS or value <= 0):
            parent[key] = SMALL_MAX_TOKENS
    return body


def _chat_messages() -> st.SearchStrategy[list[dict[str, Any]]]:
    return st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                           "content": TEXT}), min_size=1, max_size=3)


def _openai_chat(model: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"model": st.just(model), "messages": _chat_messages(),
                                  "max_tokens": st.integers(1, SMALL_MAX_TOKENS),
                                  "max_completion_tokens": st.integers(1, SMALL_MAX_TOKENS)},
                                 optional={"temperature": st.floats(0, 2), "stream": st.booleans(),
                                           "seed": st.integers(0, 2**32), "stop": st.just(["\n"])})


def _openai_completion(model: str) -> st.SearchStrategy[dict[str, Any]]:
    prompt = st.one_of(TEXT, st.lists(st.integers(0, 50), min_size=1, max_size=8))
    return st.fixed_dictionaries({"model": st.just(model), "prompt": prompt,
                                  "max_tokens": st.integers(1, SMALL_MAX_TOKENS)},
                                 optional={"temperature": st.floats(0, 2), "stream": st.booleans()})


def _responses(model: str) -> st.SearchStrategy[dict[str, Any]]:
    items = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                                            "content": TEXT}), min_size=1, max_size=2)
    return st.fixed_dictionaries({"model": st.just(model), "input": st.one_of(TEXT, items),
                                  "max_output_tokens": st.integers(1, SMALL_MAX_TOKENS)},
                                 optional={"temperature": st.floats(0, 2), "stream": st.booleans(),
                                           "instructions": TEXT})


def _anthropic(model: str) -> st.SearchStrategy[dict[str, Any]]:
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": TEXT}),
                        min_size=1, max_size=3)
    return st.fixed_dictionaries({"model": st.just(model), "messages": messages,
                                  "max_tokens": st.integers(1, SMALL_MAX_TOKENS)},
                                 optional={"temperature": st.floats(0, 1), "stream": st.booleans(), "system": TEXT,
                                           "stop_sequences": st.just(["\n"])})


def _ollama_options() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"num_predict": st.integers(1, SMALL_MAX_TOKENS)},
                                 optional={"temperature": st.floats(0, 2), "seed": st.integers(0, 2**32)})


def _ollama_chat(model: str) -> st.SearchStrategy[dict[str, Any]]:
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                               "content": TEXT}), min_size=1, max_size=3)
    return st.fixed_dictionaries({"model": st.just(model), "messages": messages, "options": _ollama_options()},
                                 optional={"stream": st.booleans()})


def _ollama_generate(model: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"model": st.just(model), "prompt": TEXT, "options": _ollama_options()},
                                 optional={"stream": st.booleans(), "system": TEXT, "raw": st.booleans()})


OPENAI_CHAT = Dialect(
    "/v1/chat/completions", _openai_chat,
    ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
     "stream", "stream_options", "n", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
     "min_p", "logit_bias", "logprobs", "top_logprobs", "tools", "response_format", "tool_choice",
     "parallel_tool_calls", "user"),
    ("role", "content", "name", "tool_calls", "tool_call_id"),
    lambda body: _capped(body, "max_tokens", "max_completion_tokens"), openai_error, openai_stream_ends)
OPENAI_COMPLETION = Dialect(
    "/v1/completions", _openai_completion,
    ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
     "n", "ignore_eos", "logit_bias", "logprobs", "response_format", "echo", "best_of", "suffix", "user"), (),
    lambda body: _capped(body, "max_tokens"), openai_error, openai_stream_ends)
RESPONSES = Dialect(
    "/v1/responses", _responses,
    ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools", "tool_choice",
     "parallel_tool_calls", "text", "previous_response_id", "store", "background"), (),
    lambda body: _capped(body, "max_output_tokens", add=True), openai_error, responses_stream_ends)
ANTHROPIC = Dialect(
    "/v1/messages", _anthropic,
    ("model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
     "tools", "tool_choice", "metadata", "thinking"), ("role", "content"),
    lambda body: _capped(body, "max_tokens"), anthropic_error, anthropic_stream_ends)
OLLAMA_CHAT = Dialect(
    "/api/chat", _ollama_chat, ("model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"),
    ("role", "content", "tool_calls", "images"), lambda body: _capped(body, "options.num_predict", add=True),
    ollama_error, ollama_stream_ends)
OLLAMA_GENERATE = Dialect(
    "/api/generate", _ollama_generate,
    ("model", "prompt", "system", "raw", "format", "options", "stream", "suffix", "template", "context", "images"),
    (), lambda body: _capped(body, "options.num_predict", add=True), ollama_error, ollama_stream_ends)
DIALECTS = (OPENAI_CHAT, OPENAI_COMPLETION, RESPONSES, ANTHROPIC, OLLAMA_CHAT, OLLAMA_GENERATE)


def dialect_of(path: str) -> Dialect | None:
    """The generation endpoint `path` is (None: another route)."""
    return next((d for d in DIALECTS if d.path == path), None)


def error_check(path: str) -> Callable[[Any], None]:
    """The error shape of the dialect a path belongs to (by prefix, as the node picks it)."""
    if path.startswith("/v1/messages"):
        return anthropic_error
    if path.startswith("/api/"):
        return ollama_error
    return openai_error
