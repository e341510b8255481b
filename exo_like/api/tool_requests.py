"""Tool use in requests, dialect-neutral: which tools a request offers, whether and which one the model must call
(`ToolUse`), and the conversation's tool calls and tool results in the Hugging Face chat-template convention
(assistant messages with `tool_calls`, each `{"id", "type": "function", "function": {"name", "arguments": dict}}`;
`{"role": "tool", "tool_call_id", "name", "content"}` messages), which every model's template renders.

The OpenAI shapes are parsed here; the other dialects build the same values from their own shapes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from exo_like.api.tool_calls import Tool
from exo_like.errors import InvalidRequestError

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's (and Anthropic's) rule for function names
MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offers and how the model may use them: `choice` is auto (the model decides), none (no
    calls), required (at least one call) or function (a call of `name`)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the model's text is read for tool calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether a call is enforced by the grammar (not left to the model)."""
        return self.choice in ("required", "function")

    @property
    def single(self) -> bool:
        """At most one call: parallel calls are off, or tool_choice names the tool (OpenAI then makes exactly one
        call of it)."""
        return not self.parallel or self.choice == "function"

    def as_template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (HF's `tools=`: OpenAI's function-tool objects)."""
        return [{"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                                  "parameters": tool.parameters}} for tool in self.tools]


def check_tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    """A function tool from its parts, whatever dialect carried them; `where` names it in errors."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidRequestError(f"{where}.name must be 1 to 64 letters, digits, underscores or dashes; got "
                                  f"{str(name)[:70]!r}", param=f"{where}.name", code="invalid_value")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description must be a string", param=f"{where}.description",
                                  code="invalid_type")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.parameters must be a JSON schema object", param=f"{where}.parameters",
                                  code="invalid_type")
    return Tool(name, description, parameters)


def unique_tools(tools: list[Tool], param: str) -> tuple[Tool, ...]:
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"{param} may hold at most {MAX_TOOLS} tools, got {len(tools)}", param=param,
                                  code="invalid_value")
    names = [tool.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidRequestError(f"{param}: tool names must be unique; {repeated[0]!r} is given twice", param=param,
                                  code="invalid_value")
    return tuple(tools)


def check_choice(use: ToolUse, param: str) -> ToolUse:
    """A tool_choice that names a tool must name one of the request's; one that asks for a call needs tools."""
    if use.choice == "function" and use.name not in {tool.name for tool in use.tools}:
        raise InvalidRequestError(f"{param} names the tool {use.name!r}, which is not among the request's tools",
                                  param=param, code="invalid_value")
    if use.forced and not use.tools:
        raise InvalidRequestError(f"{param} asks for a tool call, but the request has no tools", param=param,
                                  code="invalid_value")
    return use


def openai_tool_use(body: dict[str, Any]) -> ToolUse | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of an OpenAI chat request (None: no tools offered)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls",
                                  code="invalid_type")
    if tools is None and choice in (None, "none", "auto"):
        return None
    if not isinstance(tools, list) and tools is not None:
        raise InvalidRequestError("tools must be a list of function tools", param="tools", code="invalid_type")
    offered = unique_tools([_openai_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools or [])], "tools")
    use = ToolUse(offered, *_openai_choice(choice), parallel=True if parallel is None else parallel)
    return check_choice(use, "tool_choice")


def _openai_tool(value: Any, where: str) -> Tool:
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise InvalidRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where,
                                  code="invalid_type")
    function = value["function"]
    return check_tool(function.get("name"), function.get("description"), function.get("parameters"),
                      f"{where}.function")


def _openai_choice(value: Any) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidRequestError(f"tool_choice must be one of {', '.join(CHOICES)} or a function; got "
                                      f"{value[:40]!r}", param="tool_choice", code="invalid_value")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError('tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
                                  param="tool_choice", code="invalid_type")
    return "function", function["name"]


def template_call(call_id: str, name: Any, arguments: Any, where: str) -> dict[str, Any]:
    """A tool call of the conversation as chat templates take it: its arguments a dict (OpenAI sends them as JSON
    text; templates write them with `tojson`)."""
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name must be a non-empty string", param=f"{where}.name",
                                  code="invalid_value")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise InvalidRequestError(f"{where}.arguments must be JSON text of an object", param=f"{where}.arguments",
                                      code="invalid_value") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.arguments must be a JSON object", param=f"{where}.arguments",
                                  code="invalid_value")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def openai_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, as chat templates take them."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{where}.tool_calls must be a non-empty list", param=f"{where}.tool_calls",
                                  code="invalid_type")
    calls = []
    for i, call in enumerate(value):
        here = f"{where}.tool_calls[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise InvalidRequestError(f"{here} must be {{\"id\", \"type\": \"function\", \"function\": {{...}}}}",
                                      param=here, code="invalid_type")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{here}.id must be a non-empty string", param=f"{here}.id", code="invalid_value")
        calls.append(template_call(call_id, call["function"].get("name"), call["function"].get("arguments"),
                                   f"{here}.function"))
    return calls


def link_tool_results(messages: list[dict[str, Any]], param: str = "messages") -> list[dict[str, Any]]:
    """Every tool result answers a call made earlier in the conversation; it gets that call's function name (some
    templates print it)."""
    calls: dict[str, str] = {}
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            calls[call["id"]] = call["function"]["name"]
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in calls:
                raise InvalidRequestError(
                    f"{param}[{i}] is a tool result for the call {call_id!r}, but no earlier assistant message made "
                    "that call: a tool message must answer a preceding message's tool_calls",
                    param=f"{param}[{i}].tool_call_id", code="invalid_value")
            message.setdefault("name", calls[call_id])
    return messages
