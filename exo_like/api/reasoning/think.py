"""`<think>...</think>` reasoning (Qwen3, QwQ, DeepSeek R1 and V3.1): the block at the start of the output, or, when
the template opened it in the prompt, everything up to `</think>`. Whitespace around the reasoning and between it
and the answer is dropped (as llama.cpp trims it); a block that never closes (max_tokens) is all reasoning. A
`<think>` later in the answer is answer text."""

from __future__ import annotations

from dataclasses import dataclass

from exo_like.api.reasoning import Event, Thought
from exo_like.api.tool_calls.common import partial_marker_start

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser:
    def __init__(self, inside: bool):
        self.thinking = inside
        self._mode = "reasoning" if inside else "start"  # start, reasoning, after (the close), answer
        self._buffer = ""
        self._began = False  # some reasoning text went out (leading whitespace is dropped until then)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def flush(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if self._mode == "reasoning":
            rest = rest.strip() if not self._began else rest.rstrip()
            return [Thought(rest)] if rest else []
        return [rest] if rest and self._mode in ("start", "answer") else []

    def _step(self, events: list[Event]) -> bool:
        """One move of the state machine; False when it needs more text."""
        if self._mode == "start":
            stripped = self._buffer.lstrip()
            if stripped.startswith(OPEN):
                self._buffer, self._mode, self.thinking = stripped[len(OPEN):], "reasoning", True
                return True
            if OPEN.startswith(stripped):
                return False  # empty, or a marker's beginning
            self._mode = "answer"
            return True
        if self._mode == "reasoning":
            return self._reason(events)
        if self._mode == "after":
            stripped = self._buffer.lstrip()
            self._buffer = stripped
            if not stripped:
                return False
            self._mode = "answer"
            return True
        if self._buffer:
            events.append(self._buffer)
            self._buffer = ""
        return False

    def _reason(self, events: list[Event]) -> bool:
        end = self._buffer.find(CLOSE)
        if end >= 0:
            self._think(self._buffer[:end].rstrip(), events)
            self._buffer, self._mode, self.thinking = self._buffer[end + len(CLOSE):], "after", False
            return True
        cut = partial_marker_start(self._buffer, [CLOSE])
        ready = self._buffer[:cut]
        kept = ready.rstrip()  # trailing whitespace waits: it is dropped if the close follows
        self._think(kept, events)
        self._buffer = ready[len(kept):] + self._buffer[cut:]
        return False

    def _think(self, text: str, events: list[Event]) -> None:
        if not self._began:
            text = text.lstrip()
        if text:
            self._began = True
            events.append(Thought(text))


@dataclass(frozen=True)
class ThinkFormat:
    name: str = "think"
    close: str = "\n" + CLOSE + "\n\n"
    markers: tuple[str, ...] = (OPEN, CLOSE)

    def opened(self, prompt: str) -> bool:
        tail = prompt.rstrip()
        return tail.endswith(OPEN)

    def parser(self, inside: bool) -> ThinkParser:
        return ThinkParser(inside)


THINK = ThinkFormat()
