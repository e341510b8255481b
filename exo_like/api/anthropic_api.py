"""The Anthropic Messages API as a thin adapter over the one core (api/chat.py): POST /v1/messages (a Message, or
its stream of server-sent events) and POST /v1/messages/count_tokens, with Anthropic's error body on every error
under /v1/messages.

An Anthropic request becomes a ChatRequest: `system` a system message first; text blocks the messages' content;
assistant `tool_use` blocks their tool calls and user `tool_result` blocks tool messages, in the chat-template
convention of api/tool_requests.py. `thinking` switches a reasoning model's thinking (its budget_tokens enforced);
the reasoning comes back as thinking blocks (streamed as thinking_delta). The models are text-only and one
generation answers each request, so image and document blocks, structured output and Anthropic's server tools are
refused (400), never silently dropped. (Earlier turns' thinking blocks are left out of the prompt, as Anthropic
leaves them out.)
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from exo_like.api.chat import Started, start_chat
from exo_like.api.generation import Piece, TextGeneration
from exo_like.api.lifecycle import ERROR_SHAPES_KEY, NODE_KEY, generating, read_json, record, sse, stream_out
from exo_like.api.reasoning import Thinking
from exo_like.api.requests import (MAX_STOP_STRINGS, ChatRequest, GenerationOptions, checked_text, model_name,
                                   optional_bool, optional_float, optional_int, require_object, stop_strings,
                                   structured_outputs_grammar)
from exo_like.api.tool_calls import Tool, ToolCall
from exo_like.api.tool_requests import ToolUse, check_choice, check_tool, link_tool_results, template_call, unique_tools
from exo_like.errors import InvalidRequestError
from exo_like.serving.sampling import SamplingParams

log = logging.getLogger(__name__)

PATH = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
# tool_choice.type -> ToolUse.choice
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
SERVICE_TIERS = (None, "auto", "standard_only")  # every tier here is the standard one
# The core's finish_reason -> stop_reason ("stop" with a stop string is "stop_sequence", see _stop_reason).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")  # earlier turns' reasoning: Anthropic drops it from prompts too


def add_routes(app: web.Application) -> None:
    """Register this dialect's routes and error shape."""
    app.router.add_post(PATH, messages)
    app.router.add_post(f"{PATH}/count_tokens", count_tokens)
    app[ERROR_SHAPES_KEY].append((PATH, error_shape))


def error_shape(status: int, message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    """Anthropic's error body: its error type follows from the status (other 4xx are invalid requests)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# Requests

def parse_messages_request(body: Any, counting: bool = False) -> ChatRequest:
    """A Messages request as the core's ChatRequest; `counting`: a count_tokens request (no max_tokens)."""
    body = require_object(body)
    return ChatRequest(_options(body, counting), _messages(body.get("system"), body.get("messages")),
                       _tool_use(body), _thinking(body.get("thinking")))


def _thinking(value: Any) -> Thinking:
    """Anthropic's extended thinking: enabled (with its budget_tokens), adaptive (the model decides, no budget), or
    disabled; absent, the model's own default. A model that does not reason ignores it."""
    if value is None:
        return Thinking()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return Thinking(False)
    if kind == "adaptive":
        return Thinking(True)
    if kind != "enabled":
        raise InvalidRequestError('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} '
                                  'or {"type": "disabled"}', param="thinking", code="invalid_value")
    budget = optional_int(value, "budget_tokens", minimum=1)
    if budget is None:
        raise InvalidRequestError("thinking.budget_tokens is required when thinking is enabled",
                                  param="thinking.budget_tokens", code="missing_required_parameter")
    return Thinking(True, budget)


def _options(body: dict[str, Any], counting: bool) -> GenerationOptions:
    max_tokens = optional_int(body, "max_tokens", minimum=1)
    if max_tokens is None and not counting:
        raise InvalidRequestError("max_tokens is required: the most tokens the reply may have", param="max_tokens",
                                  code="missing_required_parameter")
    _reject_unsupported(body)
    return GenerationOptions(model=model_name(body), max_tokens=max_tokens, sampling=_sampling(body),
                             stop=stop_strings(body.get("stop_sequences"), "stop_sequences", MAX_STOP_STRINGS,
                                               one_string=False, expected="a list of non-empty strings"),
                             stream=optional_bool(body, "stream") or False, include_usage=False, ignore_eos=False,
                             max_tokens_is_cap=True, grammar=structured_outputs_grammar(body.get("structured_outputs")))


def _sampling(body: dict[str, Any]) -> SamplingParams:
    temperature = optional_float(body, "temperature", 0.0, 1.0)  # Anthropic's range
    top_p = optional_float(body, "top_p", 0.0, 1.0)
    if top_p is not None and top_p <= 0.0:
        raise InvalidRequestError("top_p must be greater than 0 and at most 1", param="top_p", code="invalid_value")
    return SamplingParams(temperature=1.0 if temperature is None else temperature,
                          top_p=1.0 if top_p is None else top_p, top_k=optional_int(body, "top_k", minimum=0) or 0)


def _reject_unsupported(body: dict[str, Any]) -> None:
    output = body.get("output_config")
    if isinstance(output, dict) and output.get("format") is not None:
        raise InvalidRequestError("structured output (output_config.format) is not supported in this API; use "
                                  "/v1/chat/completions with response_format", param="output_config.format",
                                  code="unsupported_parameter")
    if body.get("service_tier") not in SERVICE_TIERS:
        raise InvalidRequestError("service_tier must be auto or standard_only", param="service_tier",
                                  code="invalid_value")


def _messages(system: Any, turns: Any) -> list[dict[str, Any]]:
    if not isinstance(turns, list) or not turns:
        raise InvalidRequestError("messages must be a non-empty list", param="messages",
                                  code="missing_required_parameter" if turns is None else "invalid_value")
    conversation = _Conversation()
    if system is not None:
        text = checked_text(system, "system") if isinstance(system, str) else _text_blocks(system, "system")
        conversation.messages.append({"role": "system", "content": text})
    for i, turn in enumerate(turns):
        conversation.add(turn, f"messages[{i}]")
    return link_tool_results(conversation.messages)  # checked already; gives each result its call's name


class _Conversation:
    """Anthropic's system prompt and turns as chat-template messages, with the tool_use ids made so far (a
    tool_result must answer one of them)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.calls: set[str] = set()

    def add(self, turn: Any, where: str) -> None:
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ("user", "assistant"):
            raise InvalidRequestError(f"{where} must be an object whose role is user or assistant", param=where,
                                      code="invalid_value")
        content = turn.get("content")
        if isinstance(content, str):
            self.messages.append({"role": role, "content": checked_text(content, f"{where}.content")})
            return
        if not isinstance(content, list):
            raise InvalidRequestError(f"{where}.content must be a string or a list of content blocks",
                                      param=f"{where}.content", code="invalid_type")
        blocks = [(_block_type(block, f"{where}.content[{j}]"), block, f"{where}.content[{j}]")
                  for j, block in enumerate(content)]
        if role == "assistant":
            self._assistant(blocks)
        else:
            self._user(blocks)

    def _assistant(self, blocks: list[tuple[str, dict[str, Any], str]]) -> None:
        texts, calls = [], []
        for kind, block, where in blocks:
            if kind == "text":
                texts.append(_text(block, where))
            elif kind == "tool_use":
                calls.append(_tool_call(block, where))
                self.calls.add(calls[-1]["id"])
            elif kind not in SKIPPED_BLOCKS:
                raise _unsupported_block(kind, where, "assistant")
        message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        self.messages.append({**message, "tool_calls": calls} if calls else message)

    def _user(self, blocks: list[tuple[str, dict[str, Any], str]]) -> None:
        """Tool results first, one tool message each, then the turn's text as a user message (Anthropic requires
        that order: text before a tool_result is a 400 there too)."""
        texts: list[str] = []
        for kind, block, where in blocks:
            if kind == "text":
                texts.append(_text(block, where))
            elif kind == "tool_result" and texts:
                raise InvalidRequestError(f"{where}: tool_result blocks must come before any text in a user message",
                                          param=where, code="invalid_value")
            elif kind == "tool_result":
                self.messages.append(self._tool_result(block, where))
            else:
                raise _unsupported_block(kind, where, "user")
        if texts or not blocks:
            self.messages.append({"role": "user", "content": "\n".join(texts)})

    def _tool_result(self, block: dict[str, Any], where: str) -> dict[str, Any]:
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or call_id not in self.calls:
            raise InvalidRequestError(
                f"{where} is a tool_result for tool_use_id {str(call_id)[:80]!r}, but no earlier assistant message "
                "has a tool_use block with that id", param=f"{where}.tool_use_id", code="invalid_value")
        optional_bool(block, "is_error", param=f"{where}.is_error")
        content = block.get("content")
        if content is None or isinstance(content, str):
            text = checked_text(content or "", f"{where}.content")
        else:
            text = _text_blocks(content, f"{where}.content")
        return {"role": "tool", "tool_call_id": call_id, "content": text}


def _text_blocks(value: Any, where: str) -> str:
    """A list of text blocks (a system prompt's, a tool result's) as one text."""
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks", param=where,
                                  code="invalid_type")
    texts = []
    for j, block in enumerate(value):
        kind = _block_type(block, f"{where}[{j}]")
        if kind != "text":
            raise _unsupported_block(kind, f"{where}[{j}]", "text")
        texts.append(_text(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequestError(f"{where} must be a content block: an object with a type", param=where,
                                  code="invalid_type")
    return block["type"]


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequestError(f"{where}.text must be a string", param=f"{where}.text", code="invalid_type")
    return checked_text(block["text"], f"{where}.text")


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, arguments = block.get("id"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"{where}.id must be a non-empty string", param=f"{where}.id", code="invalid_value")
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.input must be an object", param=f"{where}.input", code="invalid_type")
    return template_call(call_id, block.get("name"), arguments, where)


def _unsupported_block(kind: str, where: str, holder: str) -> InvalidRequestError:
    """`holder`: what holds the block (an assistant or a user message, or a list of text blocks)."""
    accepted = {"assistant": "text and tool_use", "user": "text and tool_result"}.get(holder, "text")
    reason = "this model accepts text only" if kind in ("image", "document") else f"{accepted} blocks only"
    return InvalidRequestError(f"{where}: content block type {kind[:40]!r} is not supported here: {reason}",
                               param=f"{where}.type", code="unsupported_content")


def _tool_use(body: dict[str, Any]) -> ToolUse | None:
    """`tools` and `tool_choice` (None: no tools offered and no choice made)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and choice is None:
        return None
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of tools", param="tools", code="invalid_type")
    offered = unique_tools([_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools or [])], "tools")
    return check_choice(ToolUse(offered, *_tool_choice(choice)), "tool_choice")


def _tool(value: Any, where: str) -> Tool:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be an object", param=where, code="invalid_type")
    if value.get("type") not in (None, "custom"):
        raise InvalidRequestError(f"{where}: the server tool {str(value['type'])[:60]!r} is not supported; this "
                                  "server offers custom tools only", param=f"{where}.type", code="unsupported_tool")
    if not isinstance(value.get("input_schema"), dict):
        raise InvalidRequestError(f"{where}.input_schema must be a JSON schema object", param=f"{where}.input_schema",
                                  code="invalid_type")
    return check_tool(value.get("name"), value.get("description"), value["input_schema"], where)


def _tool_choice(value: Any) -> tuple[str, str | None, bool]:
    """(ToolUse.choice, tool name, parallel calls allowed)."""
    if value is None:
        return "auto", None, True
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in TOOL_CHOICES:
        raise InvalidRequestError('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}',
                                  param="tool_choice", code="invalid_value")
    name = value.get("name")
    if kind == "tool" and not isinstance(name, str):
        raise InvalidRequestError('tool_choice {"type": "tool"} needs the name of the tool', param="tool_choice.name",
                                  code="missing_required_parameter")
    disabled = optional_bool(value, "disable_parallel_tool_use", param="tool_choice.disable_parallel_tool_use")
    return TOOL_CHOICES[kind], name if kind == "tool" else None, not disabled


# Responses

async def messages(request: web.Request) -> web.StreamResponse:
    parsed = parse_messages_request(await read_json(request))
    started = await start_chat(request.app[NODE_KEY], parsed)
    response_id = f"msg_{started.choices.request_id}"
    async with generating(request, started.choices, response_id):
        if parsed.options.stream:
            return await _stream(request, started, response_id)
        whole = (await started.choices.wholes())[0]
        record(request.app[NODE_KEY], started.choices)
        return web.json_response(_message(started, response_id, _blocks(whole)))


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens, as rendered for generation (the same count as the reply's usage.input_tokens)."""
    parsed = parse_messages_request(await read_json(request), counting=True)
    model = await request.app[NODE_KEY].models.prepare(parsed.options.model)  # its tokenizer: nothing loads
    tools = parsed.tool_use.as_template_tools() if parsed.tool_use else None  # as start_chat renders them
    return web.json_response({"input_tokens": len(model.tokenizer.encode_chat(parsed.messages, tools=tools))})


def _message(started: Started, response_id: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    """The Message: whole, or (empty content, no stop reason yet) as a stream's message_start carries it."""
    generation = started.choices.generations[0]
    stop_reason, stop_sequence = _stop_reason(generation) if generation.finish_reason else (None, None)
    return {"id": response_id, "type": "message", "role": "assistant", "model": started.model.model_id,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(generation)}


def _usage(generation: TextGeneration) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache (the prefix cache's are
    cache_read_input_tokens; nothing is written to a cache on request, so cache_creation_input_tokens is 0)."""
    return {"input_tokens": len(generation.prompt_tokens) - generation.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": generation.cached_tokens,
            "output_tokens": generation.completion_tokens}


def _stop_reason(generation: TextGeneration) -> tuple[str, str | None]:
    """stop_reason and stop_sequence: the core says "stop" both for EOS and for a stop string, and for the call of
    a named tool (OpenAI's finish), which Anthropic ends with tool_use as it ends every call."""
    if generation.finish_reason == "stop" and generation.stop_sequence is not None:
        return "stop_sequence", generation.stop_sequence
    if generation.finish_reason == "stop" and generation.called:
        return "tool_use", None
    return STOP_REASONS.get(generation.finish_reason or "length", "end_turn"), None


def _blocks(whole: Piece) -> list[dict[str, Any]]:
    thinking = [{"type": "thinking", "thinking": whole.reasoning, "signature": ""}] if whole.reasoning else []
    text = [{"type": "text", "text": whole.text}] if whole.text else []
    return thinking + text + [{**_tool_use_block(call), "input": json.loads(call.arguments)} for call in whole.calls]


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    """A call's block without its input. Its id in Anthropic's form (the calls' ids are random either way)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name}


class _StreamedBlocks:
    """The content blocks of a streamed message as they open and close: a thinking or text block stays open while
    its kind of text comes; each tool call is a block of its own (opened with empty input, its arguments one
    input_json_delta)."""

    def __init__(self) -> None:
        self.index = 0  # the block open or to open next
        self.open: str | None = None  # the kind of the block open: "thinking", "text", or none

    def events(self, piece: Piece) -> list[dict[str, Any]]:
        events = []
        if piece.reasoning:
            events += self._delta("thinking", {"type": "thinking_delta", "thinking": piece.reasoning},
                                  {"type": "thinking", "thinking": "", "signature": ""})
        if piece.text:
            events += self._delta("text", {"type": "text_delta", "text": piece.text}, {"type": "text", "text": ""})
        for call in piece.calls:
            events += self.close()
            events += [_event("content_block_start", index=self.index, content_block={**_tool_use_block(call),
                                                                                       "input": {}}),
                       _event("content_block_delta", index=self.index,
                              delta={"type": "input_json_delta", "partial_json": call.arguments}),
                       _event("content_block_stop", index=self.index)]
            self.index += 1
        return events

    def _delta(self, kind: str, delta: dict[str, Any], empty: dict[str, Any]) -> list[dict[str, Any]]:
        """A delta of a block of `kind`, opening it (and closing one of the other kind) first if need be."""
        events = []
        if self.open != kind:
            events += self.close()
            events.append(_event("content_block_start", index=self.index, content_block=empty))
            self.open = kind
        events.append(_event("content_block_delta", index=self.index, delta=delta))
        return events

    def close(self) -> list[dict[str, Any]]:
        """The open block's end, if one is open."""
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [_event("content_block_stop", index=self.index - 1)]


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


async def _stream(request: web.Request, started: Started, response_id: str) -> web.StreamResponse:
    """Server-sent events, each `event: <type>` with its JSON."""
    return await stream_out(request, started.choices, response_id, _events(request, started, response_id),
                            lambda payload: sse(payload, named=True), error_shape)


async def _events(request: web.Request, started: Started, response_id: str) -> AsyncIterator[dict[str, Any]]:
    choices = started.choices
    yield _event("message_start", message=_message(started, response_id, []))
    yield _event("ping")
    blocks = _StreamedBlocks()
    async with contextlib.aclosing(choices.pieces()) as pieces:
        async for _, piece in pieces:
            for event in blocks.events(piece) if piece is not None else blocks.close():
                yield event
    record(request.app[NODE_KEY], choices)  # before the stream ends, so a client that scrapes /metrics sees it
    stop_reason, stop_sequence = _stop_reason(choices.generations[0])
    yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                 usage=_usage(choices.generations[0]))
    yield _event("message_stop")
