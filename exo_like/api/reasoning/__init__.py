"""Reasoning kept apart from the answer, as each model family writes it: the shared types here; `detect.detect()`
picks a model's format from its chat template.

One module per format holds its streaming parser (model text in, answer text and `Thought`s out, the feed/flush
interface of the tool-call parsers, which run after it on the answer text): `think` for `<think>...</think>`
(Qwen3, QwQ, DeepSeek R1 and V3.1, including templates that open the block in the prompt), `harmony` for gpt-oss's
analysis channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Thinking:
    """What a request asks of a reasoning model, in any dialect's words: think or not (None: the model's default),
    at most `budget` tokens of it (None: no limit but max_tokens), with which effort (gpt-oss: low, medium, high).
    A model that does not reason ignores it."""

    enabled: bool | None = None
    budget: int | None = None
    effort: str | None = None


@dataclass(frozen=True)
class Thought:
    """Reasoning text (a delta of it when streamed)."""

    text: str


Event = str | Thought  # answer text, or reasoning text


class ReasoningParser(Protocol):
    thinking: bool  # inside the reasoning now (what a budget counts)

    def feed(self, text: str) -> list[Event]:
        """Streaming: text deltas in, answer deltas and reasoning deltas out."""
        ...

    def flush(self) -> list[Event]:
        """End of output: whatever is held back."""
        ...


class ReasoningFormat(Protocol):
    name: str  # "think", "harmony"
    close: str  # the text that ends the reasoning (what a spent budget appends)
    markers: tuple[str, ...]  # marker texts that may be special tokens (the text must then keep them)

    def opened(self, prompt: str) -> bool:
        """Whether a rendered prompt ends inside a reasoning block (the template opened it)."""
        ...

    def parser(self, inside: bool) -> ReasoningParser: ...


def split(events: list[Event]) -> tuple[str, str]:
    """(answer text, reasoning text) of some events."""
    return ("".join(e for e in events if isinstance(e, str)),
            "".join(e.text for e in events if isinstance(e, Thought)))
