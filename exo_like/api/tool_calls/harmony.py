"""gpt-oss's harmony format, parsed from TEXT with its special tokens kept (skip_special_tokens off).

The model's output continues a prompt ending in `<|start|>assistant`, as messages

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"a":1}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

a header (role, channel, recipient `to=...` on either side of <|channel|>, content type) up to <|message|>, then
the content up to <|end|>, <|call|> or <|return|> (the last two are stop tokens, so often absent from the text).
Final-channel content is content; a message to `functions.NAME` is a call of NAME; everything else (analysis,
commentary preambles, built-in tools such as browser or python) is dropped. Output that does not start like a
harmony header is plain content.

Parsed here from the published format (openai/harmony docs/format.md) rather than with the `openai-harmony`
package: that package downloads its tiktoken vocabulary on first use, and the nodes may have no internet access.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exo_like.api.tool_calls import Tool
from exo_like.api.tool_calls.common import StreamingParser, call_from_parts, call_grammar, first_marker, literal, \
    marker

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN)
_HEADER_STARTS = (START, CHANNEL, " to=")  # the first header may begin with the recipient, after "assistant"
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."


class HarmonyParser(StreamingParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # start (undecided), plain (not harmony), header, body, between (messages)
        self._channel = ""
        self._function: str | None = None  # the body is a call of this function

    def _end_of_output(self) -> None:
        if self._mode in ("start", "plain") or (self._mode == "body" and self._channel == "final"):
            self._sink.content(self._buffer)
        elif self._mode == "body" and self._function is not None:
            self._finish_call(self._buffer)  # its <|call|> was the stop token, not in the text
        elif self._mode == "between":
            self._stray_text(self._buffer)
        self._mode = "plain"

    def _step(self) -> bool:
        if self._mode == "start":
            return self._decide()
        if self._mode == "plain":
            self._sink.content(self._buffer)
            self._buffer = ""
            return False
        if self._mode == "header":
            return self._read_header()
        if self._mode == "body":
            return self._read_body()
        return self._between()

    def _decide(self) -> bool:
        if self._buffer.startswith(_HEADER_STARTS):
            self._mode = "header"
        elif any(start.startswith(self._buffer) for start in _HEADER_STARTS):
            return False
        else:
            self._mode = "plain"
        return True

    def _read_header(self) -> bool:
        end = self._buffer.find(MESSAGE)
        if end < 0:
            return False
        header, self._buffer = self._buffer[:end], self._buffer[end + len(MESSAGE):]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else ""
        name = recipient.group(1) if recipient else ""
        self._function = name[len(FUNCTIONS):] if name.startswith(FUNCTIONS) else None
        self._mode = "body"
        return True

    def _read_body(self) -> bool:
        # A call's arguments are parsed whole at their end; final text goes out as it comes; other text (analysis,
        # preambles) is dropped.
        calling = self._function is not None
        body, end = self._take_until(_ENDS, whole=calling)
        if self._channel == "final" and not calling:
            self._sink.content(body)
        if end is None:
            return False
        if calling:
            self._finish_call(body)
        self._mode = "between"
        return True

    def _between(self) -> bool:
        """After a message: the next header starts at <|start|> (or straight at <|channel|>). Text before it
        belongs to no message: whitespace there is dropped, anything else kept as content."""
        found = first_marker(self._buffer, (START, CHANNEL))
        if found is None:
            return False
        index = found[0]
        self._stray_text(self._buffer[:index])
        self._buffer, self._mode = self._buffer[index:], "header"
        return True

    def _stray_text(self, text: str) -> None:
        if text.strip():
            self._sink.content(text)

    def _finish_call(self, body: str) -> None:
        call = call_from_parts(self._function or "", body)
        if call is None:
            self._sink.content(body)  # not JSON arguments: keep the text rather than lose it
        else:
            self._sink.call(call)
        self._function = None


@dataclass(frozen=True)
class HarmonyFormat:
    name: str = "harmony"
    skip_special_tokens: bool = False
    markers: tuple[str, ...] = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)

    def parser(self) -> HarmonyParser:
        return HarmonyParser()

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, *,
                     special: Mapping[str, int] | None = None) -> str | None:
        return None  # the model's own template taught it this format: its output is left free

    def forced_grammar(self, tools: Sequence[Tool], name: str | None, parallel: bool, *,
                       special: Mapping[str, int] | None = None) -> str:
        """One call whatever `parallel` says: <|call|> is a stop token, so gpt-oss calls one function per turn.
        Written as the model writes calls (the prompt already ends in `<|start|>assistant`); compact JSON, as
        gpt-oss writes its arguments."""
        def call(tool: Tool, args: str) -> str:
            recipient = literal(f"commentary to={FUNCTIONS}{tool.name} ")
            return (f"{marker(CHANNEL, special)} {recipient} {marker(CONSTRAIN, special)} \"json\" "
                    f"{marker(MESSAGE, special)} {args} {marker(CALL, special)}")

        return call_grammar(tools, name, "call", call, separators=(",", ":"))


HARMONY = HarmonyFormat()
