"""The generic tool format, for models whose chat template cannot show tools (modelled on llama.cpp's "generic"
handler): the tools are described in a system message (`prompt_messages`), and a call is the whole answer, one JSON
object

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}

or, for several calls at once (offered only when parallel calls are allowed),

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]}

Any other answer is plain text. An answer whose first character (after whitespace) is "{" is held until its JSON is
complete: calls, or content after all (JSON that is not a call). docs/api.md gives the system message's text.

Earlier turns are rewritten the same way, so a template without tools can show them: an assistant message's
`tool_calls` become its content (the JSON above), and tool results become user messages of
`{"tool_result": {"id": ..., "name": ..., "content": ...}}` lines (consecutive results in one message: templates
that insist on alternating roles accept that).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from exo_like.api.tool_calls import Tool, ToolCall
from exo_like.api.tool_calls.common import JsonEnd, StreamingParser, call_from_object, call_grammar, literal

CALL_KEY, CALLS_KEY, RESULT_KEY = "tool_call", "tool_calls", "tool_result"
HEADER = ("You can call tools. These are the tools, as JSON: each one's name, description and the JSON schema of "
          "its arguments.\n")
ONE_CALL = ("\n\nTo call a tool, answer with nothing but one JSON object of this form:\n"
            '{"tool_call": {"name": "<the tool\'s name>", "arguments": {<its arguments>}}}\n')
SEVERAL_CALLS = ("To call several tools at once, answer with nothing but:\n"
                 '{"tool_calls": [{"name": "<a tool\'s name>", "arguments": {<its arguments>}}, ...]}\n')
OTHERWISE = "Otherwise, answer in plain text."


def tools_text(tools: Sequence[Tool], parallel: bool) -> str:
    """The system message text that offers `tools` (the several-calls form only when parallel calls are allowed)."""
    listed = [{"name": tool.name, "description": tool.description or "", "parameters": tool.parameters}
              for tool in tools]
    return (HEADER + json.dumps(listed, ensure_ascii=False) + ONE_CALL + (SEVERAL_CALLS if parallel else "")
            + OTHERWISE)


def prompt_messages(messages: Sequence[dict[str, Any]], tools: Sequence[Tool], parallel: bool) -> list[dict[str, Any]]:
    """The conversation as a template without tools can show it: `tools` (none: not offered) described at the start
    of the first system message (or in a new first one), earlier calls and results as text."""
    rewritten = _history_as_text(messages)
    if not tools:
        return rewritten
    offer = tools_text(tools, parallel)
    if rewritten and rewritten[0]["role"] == "system":
        first = rewritten[0]
        return [{**first, "content": offer + "\n\n" + first["content"]}, *rewritten[1:]]
    return [{"role": "system", "content": offer}, *rewritten]


def _history_as_text(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    results_open = False  # out[-1] is a user message of tool results, which the next result joins
    for message in messages:
        if message["role"] == "tool":
            line = json.dumps({RESULT_KEY: {"id": message.get("tool_call_id"), "name": message.get("name"),
                                            "content": message["content"]}}, ensure_ascii=False)
            if results_open:
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line})
            results_open = True
            continue
        results_open = False
        if message.get("tool_calls"):
            written = call_text([(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]])
            content = message["content"] + "\n" + written if message["content"] else written
            message = {key: value for key, value in message.items() if key != "tool_calls"} | {"content": content}
        out.append(message)
    return out


def call_text(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Calls, (name, arguments) each, in the generic JSON form: one call alone, several in a list."""
    objects = [{"name": name, "arguments": arguments} for name, arguments in calls]
    value = {CALL_KEY: objects[0]} if len(objects) == 1 else {CALLS_KEY: objects}
    return json.dumps(value, ensure_ascii=False)


class GenericParser(StreamingParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # start (undecided: a call's "{" may come), object (held), content (to the end)
        self._json_end = JsonEnd()

    def _end_of_output(self) -> None:
        if self._mode != "start" or self._buffer.strip() or not self._sink.called:
            self._sink.content(self._buffer)  # (a call cut short is text: it was never a call)
        self._mode, self._json_end = "start", JsonEnd()

    def _step(self) -> bool:
        if self._mode == "content":
            self._sink.content(self._buffer)
            self._buffer = ""
            return False
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if self._mode == "start":
            self._mode = "object" if stripped.startswith("{") else "content"
            return True
        return self._read_object(len(self._buffer) - len(stripped))

    def _read_object(self, leading: int) -> bool:
        """The object after `leading` whitespace: calls (then another object may follow), or content."""
        end = self._json_end.find(self._buffer[leading:])
        if end is None:
            return False
        end += leading
        calls = calls_from_json(self._buffer[leading:end])
        if calls is None:
            self._sink.content(self._buffer[:end])
            self._mode = "content"
        else:
            for call in calls:
                self._sink.call(call)
            self._mode = "start"
        self._buffer = self._buffer[end:]
        return True


def calls_from_json(text: str) -> list[ToolCall] | None:
    """The calls of a generic call object; None unless it is one whose every call is well formed."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or len(value) != 1:
        return None
    if CALL_KEY in value:
        items = [value[CALL_KEY]]
    elif isinstance(value.get(CALLS_KEY), list) and value[CALLS_KEY]:
        items = value[CALLS_KEY]
    else:
        return None
    calls = [call_from_object(item, ("arguments",)) for item in items]
    return None if any(call is None for call in calls) else calls


# The plain-text alternative of the `auto` grammar: anything whose first visible character is not "{" (or nothing).
_TEXT = r'TEXT: /\s*([^{\s][\s\S]*)?/'


@dataclass(frozen=True)
class GenericFormat:
    name: str = "generic"
    skip_special_tokens: bool = True
    markers: tuple[str, ...] = ()  # all text, no special tokens

    def parser(self) -> GenericParser:
        return GenericParser()

    def forced_grammar(self, tools: Sequence[Tool], name: str | None, parallel: bool, *,
                       special: Mapping[str, int] | None = None) -> str:
        return self._grammar(tools, name, parallel, "calls")

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, *,
                     special: Mapping[str, int] | None = None) -> str | None:
        """Plain text, or an answer that is a well-formed call. llama.cpp holds the whole answer to JSON instead
        ({"response": "..."} or a call): that makes every plain answer a JSON string a small model (the kind whose
        template has no tools) writes worse than its own text, and keeps its text from streaming as content. Here
        only an answer that starts with "{" is held to the call form, which is all the parser reads as a call, so
        a call is always valid and a plain answer costs nothing (a bare JSON answer is the one thing ruled out;
        response_format, when given, takes the place of this grammar)."""
        return self._grammar(tools, None, parallel, "calls | TEXT") + _TEXT + "\n"

    @staticmethod
    def _grammar(tools: Sequence[Tool], name: str | None, parallel: bool, start: str) -> str:
        def call(tool: Tool, args: str) -> str:
            head = literal('{"name": ' + literal(tool.name) + ', "arguments": ')
            return f'{head} {args} "}}"'

        one = literal("{" + literal(CALL_KEY) + ": ") + ' call "}"'
        several = literal("{" + literal(CALLS_KEY) + ": [") + ' call (", " call)* "]}"'
        calls = f"calls: {one} | {several}\n" if parallel else f"calls: {one}\n"
        return call_grammar(tools, name, start, call, separators=(", ", ": ")) + calls


GENERIC = GenericFormat()
