"""Tool calls as each model family writes them: the shared types here; `detect.detect()` picks a model's format.

One module per format (hermes, llama3, mistral, deepseek, harmony; generic for templates that cannot show tools)
holds its streaming parser (model text in, content deltas and complete calls out) and its forced grammar (an
llguidance Lark grammar whose language is that format's text for a call of the requested tool(s), the arguments
held to the tool's JSON schema).
Helpers the formats share are in `common`.

Special tokens in grammars: a Lark string literal only ever matches a token's TEXT bytes; llguidance keeps a
special token's bytes apart (prefixed), so a literal such as "<|call|>" never matches the special token <|call|>,
and a tokenizer that encodes the literal's text to that special token leaves the grammar stuck. A marker that is a
special token in the model's vocabulary must therefore be written as a token reference. `forced_grammar` takes
`special`, marker text -> token id, and writes those markers as `<[id]>` (ids work for any tokenizer, where the
`<name>` form only works for names in angle brackets, not Mistral's `[TOOL_CALLS]`); the other markers are
literals. `ToolFormat.markers` lists the texts that may be special, for the caller to look up in its vocabulary.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Tool:
    """An OpenAI function tool, validated already."""

    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of an object ({"type": "object", "properties": {}} when none given)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI returns it (json.dumps(..., ensure_ascii=False))
    id: str = field(default_factory=new_call_id)


Event = str | ToolCall  # a content text delta, or a complete tool call


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[Event]:
        """Streaming: text deltas in, content deltas and complete calls out."""
        ...

    def flush(self) -> list[Event]:
        """End of output: whatever is held back (as content if it never became a call)."""
        ...


class ToolFormat(Protocol):
    name: str  # "hermes", "llama3_json", "mistral", "deepseek_v3", "harmony", "generic"
    skip_special_tokens: bool  # False when the format's markers are special tokens the text must keep
    markers: tuple[str, ...]  # the marker texts that may be special tokens in a model's vocabulary

    def parser(self) -> ToolCallParser: ...

    def forced_grammar(self, tools: Sequence[Tool], name: str | None, parallel: bool, *,
                       special: Mapping[str, int] | None = None) -> str:
        """Lark grammar for one call (several when `parallel`) of tool `name`, or of any of `tools` when None.
        `special` maps the markers that are special tokens in the model's vocabulary to their ids."""
        ...

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, *,
                     special: Mapping[str, int] | None = None) -> str | None:
        """Lark grammar for tool_choice auto (text, or calls of any of `tools`); None: the output is left free."""
        ...
