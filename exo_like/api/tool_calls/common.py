"""What the tool-call formats share: the event sink every parser emits through (with its whitespace rule), the
streaming loop and marker hold-back every parser runs on, finding where a JSON value ends in a stream, turning
parsed JSON into a ToolCall, and the pieces of a forced grammar (literals, special-token markers, JSON-schema
arguments, the choice among tools)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from exo_like.api.tool_calls import Event, Tool, ToolCall


class EventSink:
    """Events in order. Once a call has been emitted, trailing whitespace is held: it is dropped when another call
    follows or the output ends, and goes out with the next text that is not whitespace. (Held whatever the
    chunking, so the same output fed whole or in pieces gives the same content.)"""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._held_whitespace = ""
        self.called = False

    def content(self, text: str) -> None:
        if not self.called:
            if text:
                self._events.append(text)
            return
        text = self._held_whitespace + text
        kept = text.rstrip()
        self._held_whitespace = text[len(kept):]
        if kept:
            self._events.append(kept)

    def call(self, call: ToolCall) -> None:
        self._held_whitespace = ""
        self.called = True
        self._events.append(call)

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def partial_marker_start(text: str, markers: Iterable[str]) -> int:
    """Where the longest suffix of `text` that could begin a marker starts (len(text) when none could): the text
    before it can go out as content, the rest must wait for more."""
    markers = list(markers)
    longest = min(len(text), max(len(m) for m in markers) - 1)
    for size in range(longest, 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return len(text) - size
    return len(text)


def first_marker(text: str, markers: Iterable[str]) -> tuple[int, str] | None:
    """The earliest of `markers` in `text`, as (index, marker); None when none is there."""
    found = [(index, m) for m in markers if (index := text.find(m)) >= 0]
    return min(found) if found else None


class StreamingParser(ABC):
    """The loop every format's parser runs: deltas gather in `_buffer`, and `_step` consumes from its front what can
    be decided now, emitting through `_sink`, until it has to wait for more text. A format writes `_step` and
    `_end_of_output`; `feed` and `flush` are the ToolCallParser protocol."""

    def __init__(self) -> None:
        self._sink = EventSink()
        self._buffer = ""

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        while self._step():
            pass
        return self._sink.take()

    def flush(self) -> list[Event]:
        self._end_of_output()
        self._buffer = ""
        return self._sink.take()

    @abstractmethod
    def _step(self) -> bool:
        """Consume what can be decided now; True when another look may decide more, False to wait for text."""

    @abstractmethod
    def _end_of_output(self) -> None:
        """The output is over: emit what the buffer still holds (as content if it never became a call) and reset
        the format's own state (the buffer is emptied after)."""

    def _take_until(self, markers: Sequence[str], *, whole: bool = False) -> tuple[str, str | None]:
        """Cut the buffer's front up to the first of `markers`, consuming the marker: (the text before it, the
        marker). With no marker in it yet: (the text that cannot be part of one, None), the tail that may be a
        marker's beginning staying for the next delta to complete; or, when `whole` (text wanted in one piece,
        such as a call's body), ("", None) with the buffer left as it is."""
        found = first_marker(self._buffer, markers)
        if found is None:
            cut = 0 if whole else partial_marker_start(self._buffer, markers)
            text, self._buffer = self._buffer[:cut], self._buffer[cut:]
            return text, None
        index, hit = found
        text, self._buffer = self._buffer[:index], self._buffer[index + len(hit):]
        return text, hit

    def _content_until(self, markers: Sequence[str]) -> str | None:
        """Emit the buffer as content up to the first of `markers`, consuming and returning the marker; None while
        none has come (content streams as it arrives, only a possible marker's beginning is held)."""
        text, hit = self._take_until(markers)
        self._sink.content(text)
        return hit


class JsonEnd:
    """Where the object or array that opens a growing text ends. Each character is read once however the text
    arrives (a held answer can be long); brackets are counted outside strings only, validity is json.loads' business
    afterwards. Once it has found a value's end it starts over, for the next value."""

    def __init__(self) -> None:
        self._read = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def find(self, text: str) -> int | None:
        """The index just past the value, or None while it is not closed yet. Until it is, `text` must be the text
        of the last call with more appended."""
        for index in range(self._read, len(text)):
            char = text[index]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._read = 0  # depth 0, outside strings: as new
                    return index + 1
        self._read = len(text)
        return None


def arguments_text(arguments: Any) -> str | None:
    """Arguments as the JSON text of an object; a string holding a JSON object is decoded first, missing ones are
    {}. None when they are not an object."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def call_from_object(value: Any, argument_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    """A {"name": ..., "arguments": ...} object as a ToolCall; None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    present = [key for key in argument_keys if key in value]
    arguments = arguments_text(value[present[0]] if present else None)
    return None if arguments is None else ToolCall(name=value["name"], arguments=arguments)


def call_from_json(text: str, argument_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    try:
        return call_from_object(json.loads(text), argument_keys)
    except json.JSONDecodeError:
        return None


def call_from_parts(name: str, arguments: str) -> ToolCall | None:
    """A call written as a bare name and the JSON text of its arguments."""
    name = name.strip()
    if not name or any(char.isspace() for char in name):
        return None
    try:
        normalised = arguments_text(json.loads(arguments))
    except json.JSONDecodeError:
        return None
    return None if normalised is None else ToolCall(name=name, arguments=normalised)


# --- grammars ---------------------------------------------------------------------------------------------------


def literal(text: str) -> str:
    """A Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)


def marker(text: str, special: Mapping[str, int] | None) -> str:
    """A format marker: a token reference when it is a special token of the vocabulary, else a literal."""
    if special and text in special:
        return f"<[{special[text]}]>"
    return literal(text)


def json_arguments(schema: dict[str, Any], item_separator: str, key_separator: str) -> str:
    """%json for arguments held to `schema`, in compact JSON with the format's separators (no free whitespace).
    Lenient: keywords llguidance cannot enforce are ignored rather than failing the whole grammar."""
    options = {"whitespace_flexible": False, "item_separator": item_separator, "key_separator": key_separator,
               "lenient": True}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def chosen_tools(tools: Sequence[Tool], name: str | None) -> list[Tool]:
    if name is None:
        if not tools:
            raise ValueError("no tools to call")
        return list(tools)
    chosen = [tool for tool in tools if tool.name == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}")
    return chosen[:1]


def call_grammar(tools: Sequence[Tool], name: str | None, start: str, call: Callable[[Tool, str], str],
                 separators: tuple[str, str]) -> str:
    """A grammar whose `start` is built from rule `call`: one alternative per chosen tool, `call(tool, args_rule)`
    its body, args_rule that tool's arguments."""
    chosen = chosen_tools(tools, name)
    lines = [f"start: {start}", "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        lines.append(f"call_{i}: {call(tool, f'args_{i}')}")
        lines.append(f"args_{i}: {json_arguments(tool.parameters, *separators)}")
    return "\n".join(lines) + "\n"
