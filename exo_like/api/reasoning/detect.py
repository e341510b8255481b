"""Which format a model writes its reasoning in, from its chat template (and model_type for gpt_oss)."""

from __future__ import annotations

from exo_like.api.reasoning import ReasoningFormat
from exo_like.api.reasoning.harmony import HARMONY
from exo_like.api.reasoning.think import CLOSE, THINK


def detect(model_type: str, chat_template: str | None) -> ReasoningFormat | None:
    """The model's reasoning format; None for a model that does not reason (its switches are then ignored)."""
    if model_type == "gpt_oss" or (chat_template and "<|channel|>" in chat_template):
        return HARMONY
    if chat_template and CLOSE in chat_template:
        return THINK
    return None
