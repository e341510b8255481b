"""gpt-oss's reasoning: the messages of its harmony `analysis` channel,

    <|channel|>analysis<|message|>thinking...<|end|><|start|>assistant<|channel|>final<|message|>answer

are reasoning; everything else passes on as it came (the final channel, calls, built-in tools' messages), for the
harmony parser of tool_calls/ to read the answer and the calls from (it runs on every gpt-oss request). Parsed from
the text with special tokens kept."""

from __future__ import annotations

from dataclasses import dataclass

from exo_like.api.reasoning import Event, Thought
from exo_like.api.tool_calls.common import partial_marker_start
from exo_like.api.tool_calls.harmony import CHANNEL, END, MESSAGE, RETURN, START

ANALYSIS = f"{CHANNEL}analysis{MESSAGE}"
FINAL = f"{CHANNEL}final{MESSAGE}"
STARTED_ANALYSIS = f"{START}assistant{ANALYSIS}"


class HarmonyReasoningParser:
    def __init__(self, inside: bool):
        self.thinking = inside
        self._buffer = ""

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._analysis(events) if self.thinking else self._passed(events):
            pass
        return events

    def flush(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if not rest:
            return []
        return [Thought(rest)] if self.thinking else [rest]

    def _passed(self, events: list[Event]) -> bool:
        """Outside the analysis channel: pass the text on up to an analysis message's header."""
        found = [(i, header) for header in (STARTED_ANALYSIS, ANALYSIS) if (i := self._buffer.find(header)) >= 0]
        if found:
            at, header = min(found)
            if self._buffer[:at]:
                events.append(self._buffer[:at])
            self._buffer, self.thinking = self._buffer[at + len(header):], True
            return True
        cut = partial_marker_start(self._buffer, [STARTED_ANALYSIS, ANALYSIS])
        if self._buffer[:cut]:
            events.append(self._buffer[:cut])
        self._buffer = self._buffer[cut:]
        return False

    def _analysis(self, events: list[Event]) -> bool:
        """Inside an analysis message: reasoning up to its end."""
        ends = [(i, end) for end in (END, RETURN) if (i := self._buffer.find(end)) >= 0]
        if ends:
            at, end = min(ends)
            if self._buffer[:at]:
                events.append(Thought(self._buffer[:at]))
            self._buffer, self.thinking = self._buffer[at + len(end):], False
            return True
        cut = partial_marker_start(self._buffer, [END, RETURN])
        if self._buffer[:cut]:
            events.append(Thought(self._buffer[:cut]))
        self._buffer = self._buffer[cut:]
        return False


@dataclass(frozen=True)
class HarmonyFormat:
    name: str = "harmony"
    close: str = f"{END}{START}assistant{FINAL}"
    markers: tuple[str, ...] = (START, CHANNEL, MESSAGE, END, RETURN)

    def opened(self, prompt: str) -> bool:
        return prompt.rstrip().endswith(ANALYSIS)

    def parser(self, inside: bool) -> HarmonyReasoningParser:
        return HarmonyReasoningParser(inside)


HARMONY = HarmonyFormat()
