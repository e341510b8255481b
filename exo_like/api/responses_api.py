"""OpenAI's Responses API, `POST /v1/responses`, as a thin adapter over the one core (api/chat.py).

A request becomes a ChatRequest: `instructions` and `input` (a string, or message, function_call and
function_call_output items) become chat messages in the template convention (api/tool_requests.py), `tools` and
`tool_choice` a ToolUse, `text.format` the structured-output schema. The generation options are built by
openai_requests itself from the equivalent chat fields, so both dialects accept and reject the same values; errors
from that shared code are renamed to this dialect's fields. Nothing is stored: `previous_response_id` (and the other
server-side state) is a 400, and clients send the whole conversation each time.

The reply is a `response` object whose output items follow the model's text: a message for a run of text, a
function_call per tool call. Streamed (SSE with `event:` lines), the same items are announced as OpenAI announces
them (response.created, output_item.added, ..., response.completed), built from the same pieces by the same code,
so a stream ends in exactly the object a non-streamed request returns. Errors have OpenAI's shape; once a stream
has started, an `error` event ends it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from exo_like.api.chat import start_chat
from exo_like.api.choices import ChoiceSet
from exo_like.api.generation import Piece
from exo_like.api.lifecycle import NODE_KEY, generating, read_json, record, sse, stream_out
from exo_like.api.openai_requests import openai_thinking, parse_chat_request
from exo_like.api.reasoning import Thinking
from exo_like.api.requests import ChatRequest, GenerationOptions, checked_text, text_content
from exo_like.api.tool_calls import Tool, ToolCall
from exo_like.api.tool_requests import CHOICES, ToolUse, check_choice, check_tool, link_tool_results, template_call, \
    unique_tools
from exo_like.errors import InvalidRequestError

log = logging.getLogger(__name__)

Event = dict[str, Any]  # a stream event: its `type`, `sequence_number` and fields

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
UNSTORED = ("previous_response_id", "conversation", "prompt", "background")  # they need state kept on the server
# This dialect's fields and the chat fields openai_requests builds the same options from.
CHAT_FIELDS = {"model": "model", "temperature": "temperature", "top_p": "top_p", "stream": "stream",
               "max_output_tokens": "max_completion_tokens", "structured_outputs": "structured_outputs"}
# Names the shared code puts in its errors, and this dialect's (the longer prefix first).
RENAMED = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
           ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("messages", "input"))


def add_routes(app: web.Application) -> None:
    """Register POST /v1/responses (errors keep OpenAI's shape, the default: no shape to register)."""
    app.router.add_post("/v1/responses", create_response)


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ChatRequest
    echo: dict[str, Any]  # the request's settings the response object repeats


def parse_responses_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    _reject_unsupported(body)
    options = _options(body)
    tool_use = _tool_use(body)
    # Each function_call_output's call was checked while reading input; linking names each after its call.
    request = ChatRequest(options, link_tool_results(_messages(body)), tool_use, _thinking(body.get("reasoning")))
    return ResponsesRequest(request, _echo(body, options, tool_use))


def _thinking(value: Any) -> Thinking:
    """Responses' reasoning: {"effort": "none" | "minimal" | "low" | "medium" | "high", "summary": ...} (a summary
    is not written: the reasoning itself comes back)."""
    if value is None:
        return Thinking()
    if not isinstance(value, dict):
        raise InvalidRequestError("reasoning must be an object", param="reasoning", code="invalid_type")
    try:
        return openai_thinking({"reasoning_effort": value.get("effort")})
    except InvalidRequestError as error:
        raise InvalidRequestError(error.message.replace("reasoning_effort", "reasoning.effort"),
                                  param="reasoning.effort", code=error.code) from None


def _in_dialect(error: InvalidRequestError) -> InvalidRequestError:
    """An error of the shared chat code, naming this dialect's field instead of chat's."""
    param = error.param or ""
    for chat_name, name in RENAMED:
        if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
            return InvalidRequestError(error.message.replace(chat_name, name, 1),
                                       param=name + param[len(chat_name):], code=error.code)
    return error


def _reject_unsupported(body: dict[str, Any]) -> None:
    for name in UNSTORED:
        value = body.get(name)
        if value is not None and value is not False:  # (background=false is fine; 0 == False is no boolean)
            raise InvalidRequestError(f"{name} is not supported: this server keeps nothing between requests (no "
                                      "stored responses, conversations, prompts or background runs); send the whole "
                                      "conversation in input", param=name, code="unsupported_parameter")


def _options(body: dict[str, Any]) -> GenerationOptions:
    chat_body: dict[str, Any] = {chat: body[name] for name, chat in CHAT_FIELDS.items() if name in body}
    chat_body["response_format"] = _response_format(body.get("text"))
    # parse_chat_request wants a message; the real ones are parsed here, where errors can name input items.
    chat_body["messages"] = [{"role": "user", "content": ""}]
    try:
        return parse_chat_request(chat_body).options
    except InvalidRequestError as e:
        raise _in_dialect(e) from None


def _response_format(text: Any) -> Any:
    """text.format in chat's response_format shape (json_schema's fields nested), to be checked as chat checks it."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("text must be an object", param="text", code="invalid_type")
    spec = text.get("format")
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        return spec
    return {"type": "json_schema", "json_schema": {key: spec[key] for key in ("name", "schema", "strict")
                                                   if key in spec}}


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    conversation = _Conversation()
    if body.get("instructions") is not None:
        conversation.messages.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    value = body.get("input")
    if value is None:
        raise InvalidRequestError("input is required", param="input", code="missing_required_parameter")
    if isinstance(value, str):
        conversation.messages.append({"role": "user", "content": _text(value, "input")})
        return conversation.messages
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input must be a string or a non-empty list of items", param="input",
                                  code="invalid_type")
    before = len(conversation.messages)
    for i, item in enumerate(value):
        conversation.add(item, f"input[{i}]")
    if len(conversation.messages) == before:
        raise InvalidRequestError("input holds no messages (reasoning items alone say nothing to the model)",
                                  param="input", code="invalid_value")
    return conversation.messages


@dataclass
class _Conversation:
    """Chat messages from input items, in order; each function_call joins the assistant message before it."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    call_ids: set[str] = field(default_factory=set)

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where, code="invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            self.messages.append(_message(item, where))
        elif kind == "function_call":
            self._add_call(item, where)
        elif kind == "function_call_output":
            self._add_result(item, where)
        elif kind != "reasoning":  # reasoning items are the model's own notes: nothing a template renders
            raise InvalidRequestError(f"{where}: input items of type {str(kind)[:40]!r} are not supported; send "
                                      "messages, function_call and function_call_output items", param=f"{where}.type",
                                      code="unsupported_parameter")

    def _add_call(self, item: dict[str, Any], where: str) -> None:
        call_id = _call_id(item, where)
        call = template_call(call_id, item.get("name"), item.get("arguments"), where)
        self.call_ids.add(call_id)
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            self.messages.append({"role": "assistant", "content": "", "tool_calls": [call]})

    def _add_result(self, item: dict[str, Any], where: str) -> None:
        call_id = _call_id(item, where)
        if call_id not in self.call_ids:
            raise InvalidRequestError(f"{where} is the output of the call {call_id!r}, but no earlier function_call "
                                      "item made that call: send the function_call item before its output",
                                      param=f"{where}.call_id", code="invalid_value")
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": text_content(item.get("output"), f"{where}.output", TEXT_PARTS)})


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(ROLES)}; got {str(role)[:40]!r}",
                                  param=f"{where}.role", code="invalid_value")
    # `developer` is OpenAI's newer name for `system`; chat templates only know the latter.
    return {"role": "system" if role == "developer" else role,
            "content": text_content(item.get("content"), f"{where}.content", TEXT_PARTS)}


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param} must be a string", param=param, code="invalid_type")
    return checked_text(value, param)


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"{where}.call_id is required: the id of the function call", param=f"{where}.call_id",
                                  code="missing_required_parameter")
    return call_id


def _tool_use(body: dict[str, Any]) -> ToolUse | None:
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls",
                                  code="invalid_type")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools", param="tools", code="invalid_type")
    offered = unique_tools([_function_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools or [])], "tools")
    kind, name = _choice(choice)
    if not offered and kind in ("auto", "none"):
        return None
    return check_choice(ToolUse(offered, kind, name, parallel=parallel is not False), "tool_choice")


def _function_tool(value: Any, where: str) -> Tool:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be an object", param=where, code="invalid_type")
    kind = value.get("type")
    if kind != "function":
        raise InvalidRequestError(f"{where}: tools of type {str(kind)[:40]!r} are not supported; this server runs no "
                                  "hosted tools, only function tools (the client runs them)", param=f"{where}.type",
                                  code="unsupported_parameter")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise InvalidRequestError(f"{where}.strict must be a boolean", param=f"{where}.strict", code="invalid_type")
    return check_tool(value.get("name"), value.get("description"), value.get("parameters"), where)


def _choice(value: Any) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str) and value in CHOICES:
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return "function", value["name"]
    if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] != "function":
        raise InvalidRequestError(f"tool_choice of type {value['type'][:40]!r} is not supported", param="tool_choice",
                                  code="unsupported_parameter")
    raise InvalidRequestError('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                              param="tool_choice", code="invalid_value")


def _echo(body: dict[str, Any], options: GenerationOptions, use: ToolUse | None) -> dict[str, Any]:
    text, metadata, user = body.get("text"), body.get("metadata"), body.get("user")
    if use is None:  # no tools, and tool_choice auto or none
        choice: Any = body.get("tool_choice") or "auto"
    else:
        choice = {"type": "function", "name": use.name} if use.choice == "function" else use.choice
    tools = [{"type": "function", "name": tool.name, "description": tool.description, "parameters": tool.parameters,
              "strict": spec.get("strict")} for tool, spec in zip(use.tools if use else (), body.get("tools") or ())]
    return {"instructions": body.get("instructions"), "max_output_tokens": options.max_tokens,
            "metadata": metadata if isinstance(metadata, dict) else None,
            "user": user if isinstance(user, str) else None, "tool_choice": choice, "tools": tools,
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": options.sampling.temperature, "top_p": options.sampling.top_p,
            "text": {"format": text["format"] if isinstance(text, dict) and text.get("format") else {"type": "text"}},
            "truncation": "disabled", "previous_response_id": None,
            "reasoning": body.get("reasoning") if isinstance(body.get("reasoning"), dict) else None}


@dataclass
class ResponseEvents:
    """One response: its object, and the stream events that build it as pieces of output arrive. The object's
    output holds the items finished so far; text goes into an open message item until a call or the end."""

    response_id: str
    model: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    sequence: int = 0
    message_id: str | None = None  # the open message item's
    texts: list[str] = field(default_factory=list)  # its text so far
    reasoning_id: str | None = None  # the open reasoning item's
    thoughts: list[str] = field(default_factory=list)  # its text so far

    def start(self) -> list[Event]:
        in_progress = self._response("in_progress")
        return [self._event("response.created", response=in_progress),
                self._event("response.in_progress", response=in_progress)]

    def add(self, piece: Piece) -> list[Event]:
        events = []
        if piece.reasoning:
            events += self._close_message("completed")
            events += self._open_reasoning() if self.reasoning_id is None else []
            self.thoughts.append(piece.reasoning)
            events.append(self._event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                      output_index=len(self.output), content_index=0, delta=piece.reasoning))
        if piece.text:
            events += self._close_reasoning()
            events += self._open_message() if self.message_id is None else []
            self.texts.append(piece.text)
            events.append(self._event("response.output_text.delta", item_id=self.message_id,
                                      output_index=len(self.output), content_index=0, delta=piece.text, logprobs=[]))
        for call in piece.calls:
            events += self._close_reasoning() + self._close_message("completed") + self._call(call)
        return events

    def _open_reasoning(self) -> list[Event]:
        self.reasoning_id = "rs_" + secrets.token_hex(16)
        return [self._event("response.output_item.added", output_index=len(self.output),
                            item=self._reasoning("in_progress", []))]

    def _close_reasoning(self) -> list[Event]:
        if self.reasoning_id is None:
            return []
        text, place = "".join(self.thoughts), {"item_id": self.reasoning_id, "output_index": len(self.output)}
        item = self._reasoning("completed", [{"type": "reasoning_text", "text": text}])
        events = [self._event("response.reasoning_text.done", **place, content_index=0, text=text),
                  self._event("response.output_item.done", output_index=len(self.output), item=item)]
        self.output.append(item)
        self.reasoning_id, self.thoughts = None, []
        return events

    def _reasoning(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [], "content": content}

    def finish(self, finish_reason: str, usage: dict[str, Any]) -> list[Event]:
        """The events that end the response; the last one carries the whole response object."""
        cut = finish_reason == "length"
        events = self._close_reasoning() + self._close_message("incomplete" if cut else "completed")
        whole = self._response("incomplete" if cut else "completed", _usage(usage))
        if cut:
            whole["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            whole["completed_at"] = int(time.time())
        return events + [self._event("response.incomplete" if cut else "response.completed", response=whole)]

    def error(self, message: str, code: str | None, param: str | None = None) -> Event:
        return self._event("error", code=code, message=message, param=param)

    def _open_message(self) -> list[Event]:
        self.message_id = "msg_" + secrets.token_hex(16)
        place = {"output_index": len(self.output)}
        return [self._event("response.output_item.added", item=self._message("in_progress", []), **place),
                self._event("response.content_part.added", item_id=self.message_id, **place, content_index=0,
                            part=_text_part(""))]

    def _close_message(self, status: str) -> list[Event]:
        if self.message_id is None:
            return []
        text, place = "".join(self.texts), {"item_id": self.message_id, "output_index": len(self.output)}
        item = self._message(status, [_text_part(text)])
        events = [self._event("response.output_text.done", **place, content_index=0, text=text, logprobs=[]),
                  self._event("response.content_part.done", **place, content_index=0, part=_text_part(text)),
                  self._event("response.output_item.done", output_index=len(self.output), item=item)]
        self.output.append(item)
        self.message_id, self.texts = None, []
        return events

    def _message(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def _call(self, call: ToolCall) -> list[Event]:
        item = {"type": "function_call", "id": "fc_" + secrets.token_hex(16), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed"}
        place = {"item_id": item["id"], "output_index": len(self.output)}
        events = [
            self._event("response.output_item.added", output_index=len(self.output),
                        item={**item, "arguments": "", "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", **place, delta=call.arguments),
            self._event("response.function_call_arguments.done", **place, arguments=call.arguments),
            self._event("response.output_item.done", output_index=len(self.output), item=item)]
        self.output.append(item)
        return events

    def _response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": None, "model": self.model, "output": list(self.output),
                "usage": usage, **self.echo}

    def _event(self, kind: str, **fields: Any) -> Event:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage["completion_tokens_details"]["reasoning_tokens"]},
            "total_tokens": usage["total_tokens"]}


async def create_response(request: web.Request) -> web.StreamResponse:
    parsed = parse_responses_request(await read_json(request))
    try:
        started = await start_chat(request.app[NODE_KEY], parsed.chat)
    except InvalidRequestError as e:
        raise _in_dialect(e) from None
    events = ResponseEvents(f"resp_{started.choices.request_id}", started.model.model_id, parsed.echo)
    async with generating(request, started.choices, events.response_id):
        if parsed.chat.options.stream:
            return await _stream(request, started.choices, events)
        async with contextlib.aclosing(_every_event(request, started.choices, events)) as every_event:
            async for event in every_event:
                last = event
        return web.json_response(last["response"])


async def _every_event(request: web.Request, choices: ChoiceSet, events: ResponseEvents) -> AsyncIterator[Event]:
    """The response's events as its generation goes; the last one carries the whole response."""
    for event in events.start():
        yield event
    async with contextlib.aclosing(choices.pieces()) as pieces:
        async for _, piece in pieces:
            for event in events.add(piece) if piece is not None else ():
                yield event
    record(request.app[NODE_KEY], choices)  # counted before the client sees the end (it may scrape at once)
    for event in events.finish(choices.generations[0].finish_reason or "length", choices.usage()):
        yield event


async def _stream(request: web.Request, choices: ChoiceSet, events: ResponseEvents) -> web.StreamResponse:
    """Server-sent events, each `event: <type>` with its JSON, numbered."""
    return await stream_out(request, choices, events.response_id, _every_event(request, choices, events),
                            lambda event: sse(event, named=True),
                            lambda status, message, type_, param, code: events.error(message, code or type_, param))
