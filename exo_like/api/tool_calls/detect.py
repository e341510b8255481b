"""Which format a model writes tool calls in, read from its chat template: `detect()`.

It knows every format module; the formats know only the shared types (the package) and `common`."""

from __future__ import annotations

import re

from exo_like.api.tool_calls import ToolFormat, deepseek, harmony, hermes, llama3, mistral

_MENTIONS_TOOLS = re.compile(r"\btools\b")


def detect(model_type: str, chat_template: str | None) -> ToolFormat | None:
    """The format a model writes tool calls in, from its chat template (and model_type for gpt_oss); None when the
    template cannot render tools at all (it never mentions `tools`).

    A template that renders tools but shows none of the known call markers gets hermes, the most common format
    (a model handed tool definitions without a format of its own is most likely to follow JSON in tags)."""
    if model_type == "gpt_oss":
        return harmony.HARMONY
    if not chat_template or not _MENTIONS_TOOLS.search(chat_template):
        return None
    if "<|channel|>" in chat_template:
        return harmony.HARMONY
    if deepseek.CALLS_BEGIN in chat_template:
        return deepseek.V3 if "```json" in chat_template else deepseek.V3_1
    if mistral.TOOL_CALLS in chat_template:
        return mistral.NAME_ARGS if mistral.ARGS in chat_template else mistral.JSON_LIST
    if hermes.CALL_START in chat_template:
        return hermes.HERMES
    if llama3.PYTHON_TAG in chat_template or "Environment: ipython" in chat_template:
        return llama3.LLAMA3
    return hermes.HERMES
