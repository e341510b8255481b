"""The JSON shapes of OpenAI responses: whole completions, streamed chunks, and errors."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True)
class ResponseFormat:
    """Builds the bodies of one response; `chat` selects chat.completion vs text_completion shapes."""

    chat: bool
    response_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def whole(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._header("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage}

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role; completion streams have no such chunk."""
        if not self.chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None)

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text} if self.chat else text, None)

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({} if self.chat else "", finish_reason)

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._header(self._chunk_object), "choices": [], "usage": usage}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, delta: dict[str, str] | str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._header(self._chunk_object), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: every chunk carries usage, null until the final usage chunk
        return chunk

    def _header(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}
