"""DeepSeek V3 / R1 tool calls, a section of calls between markers:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(calls separated by a newline), and DeepSeek V3.1's shorter call, name before the separator and bare JSON after:
`<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>` (no separator between calls).
The parser takes both; the grammar forces the one the template writes. The markers' bars and spaces are the
full-width "｜" and "▁" characters. skip_special_tokens is off so the markers stay in the text whether or not a
tokenizer marks them special.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exo_like.api.tool_calls import Tool, ToolCall
from exo_like.api.tool_calls.common import StreamingParser, call_from_parts, call_grammar, literal, marker

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"  # around V3's arguments
_FENCED = re.compile(r"\s*(\S+)\s*\n```(?:json)?[ \t]*\n?(.*?)\n?```\s*", re.DOTALL)


class DeepSeekParser(StreamingParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = "content"  # content, section (between calls), call (a call's body in _buffer)
        # The section's markers and whitespace read so far: given back as text unless the section holds a call.
        self._structure = ""
        self._calls_in_section = 0

    def _end_of_output(self) -> None:
        if self._mode == "call":
            self._finish_call(self._buffer, CALL_BEGIN, "")
        elif self._mode == "section":
            self._end_section(self._buffer)
        else:
            self._sink.content(self._buffer)
        self._mode = "content"

    def _step(self) -> bool:
        if self._mode == "content":
            return self._scan_content()
        if self._mode == "section":
            return self._scan_section()
        body, end = self._take_until((CALL_END,), whole=True)
        if end is None:
            return False
        self._finish_call(body, CALL_BEGIN, CALL_END)
        self._mode = "section"
        return True

    def _scan_content(self) -> bool:
        found = self._content_until((CALLS_BEGIN, CALL_BEGIN))
        if found is None:
            return False
        # A call without the section marker (seen when the begin marker was left out) opens the section itself.
        self._structure, self._calls_in_section = (CALLS_BEGIN if found == CALLS_BEGIN else ""), 0
        self._mode = "section" if found == CALLS_BEGIN else "call"
        return True

    def _scan_section(self) -> bool:
        stripped = self._buffer.lstrip()
        leading = self._buffer[:len(self._buffer) - len(stripped)]
        if stripped.startswith(CALL_BEGIN):
            self._structure += leading
            self._buffer, self._mode = stripped[len(CALL_BEGIN):], "call"
        elif stripped.startswith(CALLS_END):
            self._end_section(leading + CALLS_END)
            self._buffer, self._mode = stripped[len(CALLS_END):], "content"
        elif not stripped or CALL_BEGIN.startswith(stripped) or CALLS_END.startswith(stripped):
            return False
        else:
            self._end_section("")  # text inside the section: it is content, and the section is over
            self._mode = "content"
        return True

    def _finish_call(self, body: str, begin: str, end: str) -> None:
        call = _call_from_body(body)
        if call is not None:
            self._sink.call(call)
            self._calls_in_section += 1
            self._structure = ""
        else:
            self._give_back(begin + body + end)

    def _give_back(self, text: str) -> None:
        """`text` is content, after the section's structure so far when no call has made that structure."""
        if not self._calls_in_section:
            text = self._structure + text
        self._structure = ""
        self._sink.content(text)

    def _end_section(self, closing: str) -> None:
        """The section is over: its markers (and `closing`) are text after all unless it held a call."""
        if not self._calls_in_section:
            self._sink.content(self._structure + closing)
        self._structure = ""


def _call_from_body(body: str) -> ToolCall | None:
    """`function<sep>NAME\\n```json\\n{...}\\n```` (V3) or `NAME<sep>{...}` (V3.1)."""
    head, sep, rest = body.partition(SEP)
    if not sep:
        return None
    fenced = _FENCED.fullmatch(rest)
    if fenced:
        return call_from_parts(fenced.group(1), fenced.group(2))
    return call_from_parts(head, rest)


@dataclass(frozen=True)
class DeepSeekFormat:
    fenced: bool  # V3 / R1: "function" + name + fenced JSON; V3.1: name + bare JSON
    name: str = "deepseek_v3"
    skip_special_tokens: bool = False
    markers: tuple[str, ...] = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def parser(self) -> DeepSeekParser:
        return DeepSeekParser()

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, *,
                     special: Mapping[str, int] | None = None) -> str | None:
        return None  # the model's own template taught it this format: its output is left free

    def forced_grammar(self, tools: Sequence[Tool], name: str | None, parallel: bool, *,
                       special: Mapping[str, int] | None = None) -> str:
        begin, end, sep = marker(CALL_BEGIN, special), marker(CALL_END, special), marker(SEP, special)

        def call(tool: Tool, args: str) -> str:
            if self.fenced:
                return f'{begin} "function" {sep} {literal(tool.name + FENCE_OPEN)} {args} {literal(FENCE_CLOSE)} {end}'
            return f"{begin} {literal(tool.name)} {sep} {args} {end}"

        calls = "call"
        if parallel:
            calls = 'call ("\\n" call)*' if self.fenced else "call+"
        start = f"{marker(CALLS_BEGIN, special)} {calls} {marker(CALLS_END, special)}"
        return call_grammar(tools, name, start, call, separators=(", ", ": "))


V3 = DeepSeekFormat(fenced=True)
V3_1 = DeepSeekFormat(fenced=False)
