"""Mistral tool calls, after the [TOOL_CALLS] control token, in either of two forms:

- a JSON list (Mistral 7B v0.3, Mixtral, Nemo; tokenizers before v11):
  `[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]` (the space only with SentencePiece)
- name then arguments (tokenizers v11+: Mistral Small 3.2, Magistral, Ministral 3, Devstral 2):
  `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, each call with its own [TOOL_CALLS]; v11 puts
  `[CALL_ID]abcDEF123` between the name and [ARGS].

The parser takes both (and a name directly followed by its JSON, as left when [ARGS] was skipped). The markers are
special tokens, kept in the text (skip_special_tokens off). Which form the grammar forces comes from the template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exo_like.api.tool_calls import Tool, ToolCall
from exo_like.api.tool_calls.common import JsonEnd, StreamingParser, call_from_object, call_from_parts, call_grammar, \
    literal, marker

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_HEADER = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?\s*")
_HEADER_SO_FAR = re.compile(r"[A-Za-z0-9_.\-\[\]]*\s*")  # what may come of a name-form header before its JSON


class MistralParser(StreamingParser):
    def __init__(self) -> None:
        super().__init__()
        self._after_marker = False  # _buffer follows a [TOOL_CALLS]
        self._json_end = JsonEnd()

    def _end_of_output(self) -> None:
        self._sink.content((TOOL_CALLS if self._after_marker else "") + self._buffer)
        self._after_marker, self._json_end = False, JsonEnd()

    def _step(self) -> bool:
        if not self._after_marker:
            self._after_marker = self._content_until((TOOL_CALLS,)) is not None
            return self._after_marker
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if stripped.startswith(("[", "{")):
            return self._read_json(stripped)
        return self._read_named(stripped)

    def _read_json(self, text: str) -> bool:
        end = self._json_end.find(text)
        if end is None:
            return False
        calls = _calls_from_list(text[:end])
        if calls is None:
            self._sink.content(TOOL_CALLS + self._buffer[:len(self._buffer) - len(text) + end])
        for call in calls or []:
            self._sink.call(call)
        self._buffer, self._after_marker = text[end:], False
        return True

    def _read_named(self, text: str) -> bool:
        brace = text.find("{")
        header = _HEADER.fullmatch(text[:brace]) if brace > 0 else None
        if header is None:
            if brace < 0 and _HEADER_SO_FAR.fullmatch(text):
                return False  # the name, or [CALL_ID] / [ARGS], still coming
            self._not_a_call()
            return True
        end = self._json_end.find(text[brace:])
        if end is None:
            return False
        end += brace
        call = call_from_parts(header.group(1), text[brace:end])
        if call is None:
            self._sink.content(TOOL_CALLS + self._buffer[:len(self._buffer) - len(text) + end])
        else:
            self._sink.call(call)
        self._buffer, self._after_marker = text[end:], False
        return True

    def _not_a_call(self) -> None:
        """[TOOL_CALLS] followed by something no call starts with: the marker is text, and what follows is read
        as content again."""
        self._sink.content(TOOL_CALLS)
        self._after_marker = False


def _calls_from_list(text: str) -> list[ToolCall] | None:
    """Every call of a JSON list of calls (or of one call object); None unless all of them are calls."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = [items] if isinstance(items, dict) else items
    if not isinstance(items, list) or not items:
        return None
    calls = [call_from_object(item, ("arguments",)) for item in items]
    return None if any(call is None for call in calls) else calls


@dataclass(frozen=True)
class MistralFormat:
    form: str  # "json_list" or "name_args": what the grammar forces
    name: str = "mistral"
    skip_special_tokens: bool = False
    markers: tuple[str, ...] = (TOOL_CALLS, ARGS, CALL_ID)

    def parser(self) -> MistralParser:
        return MistralParser()

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, *,
                     special: Mapping[str, int] | None = None) -> str | None:
        return None  # the model's own template taught it this format: its output is left free

    def forced_grammar(self, tools: Sequence[Tool], name: str | None, parallel: bool, *,
                       special: Mapping[str, int] | None = None) -> str:
        calls_marker = marker(TOOL_CALLS, special)
        if self.form == "name_args":
            def call(tool: Tool, args: str) -> str:
                return f"{calls_marker} {literal(tool.name)} {marker(ARGS, special)} {args}"

            return call_grammar(tools, name, "call+" if parallel else "call", call, separators=(", ", ": "))

        def item(tool: Tool, args: str) -> str:
            head = literal('{"name": ' + literal(tool.name) + ', "arguments": ')
            return f'{head} {args} "}}"'

        # The optional space: SentencePiece models write "[TOOL_CALLS] [", tekken ones "[TOOL_CALLS][".
        items = 'call (", " call)*' if parallel else "call"
        return call_grammar(tools, name, f'{calls_marker} " "? "[" {items} "]"', item, separators=(", ", ": "))


JSON_LIST = MistralFormat(form="json_list")
NAME_ARGS = MistralFormat(form="name_args")
