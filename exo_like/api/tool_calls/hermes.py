"""Hermes-style tool calls (Hermes 2 Pro / 3, Qwen2.5, Qwen3): each call a JSON object in tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls one after the other, separated by a newline, text possibly before them. The tags are ordinary text
(in Qwen's vocabulary they are added tokens that are not special), so skip_special_tokens can stay on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exo_like.api.tool_calls import Tool
from exo_like.api.tool_calls.common import StreamingParser, call_from_json, call_grammar, literal, marker

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_FIRST_VISIBLE = re.compile(r"\s*(\S)")


class HermesParser(StreamingParser):
    def __init__(self) -> None:
        super().__init__()
        self._in_call = False  # after a CALL_START, its body in _buffer
        self._searched = 0  # the body holds no CALL_END before this (long arguments are not searched again)

    def _end_of_output(self) -> None:
        if self._in_call:
            # A call cut short of its end tag still counts when its JSON is whole (output ended by max_tokens or
            # a stop token right after the object); otherwise it was never a call.
            self._finish_call(self._buffer, closed=False)
        else:
            self._sink.content(self._buffer)
        self._in_call = False

    def _step(self) -> bool:
        if not self._in_call:
            if self._content_until((CALL_START,)) is None:
                return False
            self._in_call, self._searched = True, 0
            return True
        first = _FIRST_VISIBLE.match(self._buffer)
        if first and first.group(1) != "{":
            # "<tool_call>" mentioned in prose: give the tag back as text and carry on after it.
            self._sink.content(CALL_START)
            self._in_call = False
            return True
        end = self._buffer.find(CALL_END, self._searched)
        if end < 0:
            self._searched = max(0, len(self._buffer) - len(CALL_END) + 1)
            return False
        self._finish_call(self._buffer[:end], closed=True)
        self._buffer = self._buffer[end + len(CALL_END):]
        self._in_call = False
        return True

    def _finish_call(self, body: str, closed: bool) -> None:
        call = call_from_json(body)
        if call is not None:
            self._sink.call(call)
        else:
            self._sink.content(CALL_START + body + (CALL_END if closed else ""))


@dataclass(frozen=True)
class HermesFormat:
    name: str = "hermes"
    skip_special_tokens: bool = True
    markers: tuple[str, ...] = (CALL_START, CALL_END)

    def parser(self) -> HermesParser:
        return HermesParser()

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, *,
                     special: Mapping[str, int] | None = None) -> str | None:
        return None  # the model's own template taught it this format: its output is left free

    def forced_grammar(self, tools: Sequence[Tool], name: str | None, parallel: bool, *,
                       special: Mapping[str, int] | None = None) -> str:
        def call(tool: Tool, args: str) -> str:
            head = literal('\n{"name": ' + literal(tool.name) + ', "arguments": ')
            tail = literal("}\n")
            return f"{marker(CALL_START, special)} {head} {args} {tail} {marker(CALL_END, special)}"

        start = 'call ("\\n" call)*' if parallel else "call"
        return call_grammar(tools, name, start, call, separators=(", ", ": "))


HERMES = HermesFormat()
