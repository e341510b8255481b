"""OpenAI's chat completions and (legacy) completions as a thin adapter over the one core (api/chat.py):
POST /v1/chat/completions and POST /v1/completions (a whole body, or server-sent event chunks ending in [DONE]), and
GET /v1/models[/{id}]; the bodies are parsed in openai_requests.py.

Below the handlers, the JSON shapes of OpenAI's replies: whole completions, streamed chunks, log-probabilities, and
errors (error_body, also the default error shape of every route, see routes.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from exo_like.api.chat import start_chat, start_completion
from exo_like.api.choices import ChoiceSet
from exo_like.api.generation import Piece
from exo_like.api.lifecycle import NODE_KEY, generating, read_json, record, sse, stream_out
from exo_like.api.openai_requests import parse_chat_request, parse_completion_request
from exo_like.api.tool_calls import ToolCall
from exo_like.serving.sampling import Choice


def add_routes(app: web.Application) -> None:
    """Register this dialect's routes (its error shape is the default: routes.py's error middleware)."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_chat_request(await read_json(request))
    started = await start_chat(request.app[NODE_KEY], parsed)
    fmt = ResponseFormat(True, f"chatcmpl-{started.choices.request_id}", started.model.model_id,
                         parsed.options.include_usage, token_text=started.token_text(parsed.options))
    return await _respond(request, started.choices, fmt, parsed.options.stream)


async def completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion_request(await read_json(request))
    started = await start_completion(request.app[NODE_KEY], parsed)
    fmt = ResponseFormat(False, f"cmpl-{started.choices.request_id}", started.model.model_id,
                         parsed.options.include_usage, token_text=started.token_text(parsed.options))
    return await _respond(request, started.choices, fmt, parsed.options.stream)


async def _respond(request: web.Request, choices: ChoiceSet, fmt: ResponseFormat,
                   stream: bool) -> web.StreamResponse:
    async with generating(request, choices, fmt.response_id):
        if stream:
            return await _stream(request, choices, fmt)
        wholes = await choices.wholes()
        record(request.app[NODE_KEY], choices)
        return web.json_response(fmt.whole([(whole, generation.finish_reason or "length")
                                            for whole, generation in zip(wholes, choices.generations)],
                                           choices.usage()))


async def _stream(request: web.Request, choices: ChoiceSet, fmt: ResponseFormat) -> web.StreamResponse:
    """Server-sent events: chunks as text arrives, a finish chunk, an optional usage chunk, then [DONE]."""
    return await stream_out(request, choices, fmt.response_id, _chunks(request, choices, fmt), sse,
                            lambda status, message, type_, param, code: error_body(message, type_, param, code),
                            trailer=b"data: [DONE]\n\n")


async def _chunks(request: web.Request, choices: ChoiceSet, fmt: ResponseFormat) -> AsyncIterator[dict[str, Any]]:
    for index in range(len(choices.generations)):
        if (first := fmt.first_chunk(index)) is not None:
            yield first
    calls = [0] * len(choices.generations)  # tool calls streamed so far, per choice
    async with contextlib.aclosing(choices.pieces()) as pieces:
        async for index, piece in pieces:
            if piece is None:
                yield fmt.finish_chunk(choices.generations[index].finish_reason or "length", index)
                continue
            for chunk in fmt.piece_chunks(piece, index, calls[index]):
                yield chunk
            calls[index] += len(piece.calls)
    record(request.app[NODE_KEY], choices)  # before the stream ends, so a client that scrapes /metrics sees it
    if fmt.include_usage:
        yield fmt.usage_chunk(choices.usage())


async def list_models(request: web.Request) -> web.Response:
    """The served model first, then local folders, downloaded repos and the catalog, each with its `state`."""
    return web.json_response({"object": "list", "data": request.app[NODE_KEY].lifecycle.listing()})


async def get_model(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE_KEY].lifecycle.entry(request.match_info["model_id"]))


# -- the JSON shapes of OpenAI's replies ---------------------------------------------------------------------------


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
    token_text: Callable[[int], str] | None = None  # set when the request asked for log-probabilities

    def whole(self, choices: Sequence[tuple[Piece, str]], usage: dict[str, Any]) -> dict[str, Any]:
        """The response to a request: each choice's (whole piece, finish reason)."""
        return {**self._header("chat.completion" if self.chat else "text_completion"),
                "choices": [self._whole_choice(i, *choice) for i, choice in enumerate(choices)], "usage": usage}

    def _whole_choice(self, index: int, whole: Piece, finish_reason: str) -> dict[str, Any]:
        logprobs = self._logprobs(whole.tokens)
        if not self.chat:
            return {"index": index, "text": whole.text, "logprobs": logprobs, "finish_reason": finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": whole.text}
        if whole.calls:  # as OpenAI: content null when the model only called tools
            message = {"role": "assistant", "content": whole.text or None,
                       "tool_calls": [_call(call) for call in whole.calls]}
        if whole.reasoning:  # a reasoning model's, apart from the answer (vLLM's and llama.cpp's field)
            message["reasoning_content"] = whole.reasoning
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        """Chat streams open with the assistant role; completion streams have no such chunk."""
        if not self.chat:
            return None
        return self._chunk(index, {"role": "assistant", "content": ""}, None)

    def text_chunk(self, text: str, tokens: Sequence[Choice] = (), index: int = 0) -> dict[str, Any]:
        return self._chunk(index, {"content": text} if self.chat else text, None, self._logprobs(tokens))

    def piece_chunks(self, piece: Piece, index: int, calls_before: int) -> list[dict[str, Any]]:
        """A piece's chunks: its text, then each call as OpenAI streams one (its id and name with empty arguments,
        then the arguments), numbered after the choice's `calls_before` earlier calls."""
        with_text = piece.text or (piece.tokens and self.token_text is not None)
        chunks = [self._chunk(index, {"reasoning_content": piece.reasoning}, None)] if piece.reasoning else []
        if with_text:
            chunks.append(self.text_chunk(piece.text, piece.tokens, index))
        for number, call in enumerate(piece.calls, calls_before):
            chunks.append(self._chunk(index, {"tool_calls": [{**_call(call, number), "function": {
                "name": call.name, "arguments": ""}}]}, None))
            chunks.append(self._chunk(index, {"tool_calls": [{"index": number, "function": {
                "arguments": call.arguments}}]}, None))
        return chunks

    def finish_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk(index, {} if self.chat else "", finish_reason)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._header(self._chunk_object), "choices": [], "usage": usage}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index: int, delta: dict[str, Any] | str, finish_reason: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {**self._header(self._chunk_object), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: every chunk carries usage, null until the final usage chunk
        return chunk

    def _header(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _logprobs(self, tokens: Sequence[Choice]) -> dict[str, Any] | None:
        """OpenAI's log-probabilities of `tokens`: chat's list of entries, or completions' parallel lists (None when
        the request did not ask for them)."""
        if self.token_text is None:
            return None
        text = self.token_text
        if self.chat:
            return {"content": [{**_entry(text(t.token), t.logprob),
                                 "top_logprobs": [_entry(text(token), logprob) for token, logprob in t.top_logprobs]}
                                for t in tokens]}
        strings = [text(t.token) for t in tokens]
        offsets = [sum(len(s) for s in strings[:i]) for i in range(len(strings))]
        return {"tokens": strings, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{text(token): logprob for token, logprob in t.top_logprobs} for t in tokens],
                "text_offset": offsets}


def _call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    shape: dict[str, Any] = {} if index is None else {"index": index}
    return {**shape, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _entry(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
