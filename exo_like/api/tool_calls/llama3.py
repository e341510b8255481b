"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the answer IS the call, a JSON object

    {"name": "get_weather", "parameters": {"city": "Paris"}}

("arguments" is accepted for "parameters"), optionally after <|python_tag|>, several separated by ";". An answer
whose first character (after whitespace) is "{" is held until its JSON is complete: a call, or content after all
(a JSON answer that is not a call). Text that starts otherwise is content, up to a <|python_tag|> if one comes.
<|python_tag|> is a special token, dropped by skip_special_tokens, which is fine: the JSON alone is recognised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exo_like.api.tool_calls import Tool
from exo_like.api.tool_calls.common import JsonEnd, StreamingParser, call_from_json, call_grammar, literal

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(StreamingParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # start (undecided), content, object (a call's JSON expected), separator (";" or end)
        self._opening = ""  # what led to the object expected (the tag, ";"): text again if no call comes of it
        self._json_end = JsonEnd()

    def _end_of_output(self) -> None:
        if self._mode == "object" and (self._buffer.strip() or not self._sink.called):
            self._give_up(len(self._buffer))  # (a ";" after the last call, with nothing after it, is dropped)
        elif self._mode in ("start", "content"):
            self._sink.content(self._buffer)
        self._mode, self._json_end = "content", JsonEnd()

    def _step(self) -> bool:
        if self._mode == "start":
            return self._decide()
        if self._mode == "content":
            return self._scan_content()
        if self._mode == "object":
            return self._read_object()
        return self._read_separator()

    def _decide(self) -> bool:
        stripped = self._buffer.lstrip()
        leading = len(self._buffer) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            self._enter_calls(leading + len(PYTHON_TAG))
        elif stripped.startswith("{"):
            self._enter_calls(leading)
        elif not stripped or PYTHON_TAG.startswith(stripped):
            return False
        else:
            self._mode = "content"
        return True

    def _scan_content(self) -> bool:
        tag = self._content_until((PYTHON_TAG,))
        if tag is None:
            return False
        self._opening, self._mode = tag, "object"  # the tag opens the calls (cut off already, as _enter_calls does)
        return True

    def _enter_calls(self, opening: int) -> None:
        """A call's JSON is expected after the first `opening` characters of the buffer (whitespace, <|python_tag|>,
        ";")."""
        self._opening, self._buffer = self._buffer[:opening], self._buffer[opening:]
        self._mode = "object"

    def _read_object(self) -> bool:
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if not stripped.startswith("{"):
            self._give_up(0)
            return True
        end = self._json_end.find(stripped)
        if end is None:
            return False
        call = call_from_json(stripped[:end])
        if call is None:
            self._give_up(len(self._buffer) - len(stripped) + end)
            return True
        self._sink.call(call)
        self._buffer, self._mode, self._opening = stripped[end:], "separator", ""
        return True

    def _read_separator(self) -> bool:
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if stripped.startswith(";"):
            self._enter_calls(len(self._buffer) - len(stripped) + 1)
        else:
            self._mode = "content"
        return True

    def _give_up(self, held: int) -> None:
        """Not a call after all: the opening and the first `held` characters are content, and the rest is read as
        content too (where a <|python_tag|> may still start calls)."""
        self._sink.content(self._opening + self._buffer[:held])
        self._buffer, self._mode, self._opening = self._buffer[held:], "content", ""


@dataclass(frozen=True)
class Llama3Format:
    name: str = "llama3_json"
    skip_special_tokens: bool = True
    markers: tuple[str, ...] = (PYTHON_TAG,)

    def parser(self) -> Llama3Parser:
        return Llama3Parser()

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, *,
                     special: Mapping[str, int] | None = None) -> str | None:
        return None  # the model's own template taught it this format: its output is left free

    def forced_grammar(self, tools: Sequence[Tool], name: str | None, parallel: bool, *,
                       special: Mapping[str, int] | None = None) -> str:
        # No <|python_tag|>: Llama 3.1's template asks for the bare JSON for the caller's own functions (the tag
        # introduces its built-in tools), so `special` has nothing to place.
        def call(tool: Tool, args: str) -> str:
            head = literal('{"name": ' + literal(tool.name) + ', "parameters": ')
            return f'{head} {args} "}}"'

        start = 'call ("; " call)*' if parallel else "call"
        return call_grammar(tools, name, start, call, separators=(", ", ": "))


LLAMA3 = Llama3Format()
