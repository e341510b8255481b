"""Ollama's native API as a thin adapter over the one core (api/chat.py): POST /api/chat and POST /api/generate here,
the model endpoints (/api/tags, /api/show, /api/ps, /api/version) in ollama_models.py.

Requests become the ChatRequest / CompletionRequest the OpenAI dialect builds too; generations come back as Ollama's
objects, streamed as NDJSON lines. Ollama's conventions are kept: `stream` defaults to true; sampling settings are
`options` (num_predict, a cap that ends at the context's end; repeat_penalty; ...), with Ollama's defaults when
absent (temperature 0.8, top_k 40, top_p 0.9; no repeat penalty: this server's counts every earlier token, Ollama's
the last 64 only); `format` is "json" or a JSON schema; tool calls carry no ids (see CallLinker); a request without
prompt or messages is the "load the model" call (with keep_alive 0, "unload" it); `keep_alive` says how long the model
stays loaded after the request (instances/keep_alive.py reads it as Ollama does); errors are {"error": message} with
the status unchanged, and an NDJSON line mid-stream. `think` (true, false, or gpt-oss's level) switches a reasoning
model's thinking, which comes back in `thinking` (a model that does not reason ignores it, as llama.cpp does).
Rejected (400): images, generate's suffix, template and context. Ignored, as Ollama ignores options it does not
know: num_ctx (the context is the model's own) and options such as mirostat or num_thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from exo_like.api import ollama_models
from exo_like.api.chat import Started, start_chat, start_completion
from exo_like.api.choices import ChoiceSet
from exo_like.api.generation import Piece, TextGeneration
from exo_like.api.lifecycle import ERROR_SHAPES_KEY, NODE_KEY, generating, ndjson, read_json, record, stream_out
from exo_like.api.ollama_models import integer, invalid, number, text, timestamp
from exo_like.api.reasoning import Thinking
from exo_like.api.requests import (EFFORTS, ChatRequest, CompletionRequest, GenerationOptions, optional_bool,
                                   require_object, stop_strings, structured_outputs_grammar)
from exo_like.api.tool_calls import Tool, ToolCall
from exo_like.api.tool_requests import ToolUse, check_tool, link_tool_results, template_call, unique_tools
from exo_like.errors import InvalidRequestError, ModelNotFoundError
from exo_like.instances.keep_alive import parse_keep_alive
from exo_like.serving.sampling import Choice, SamplingParams

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16  # Ollama sets no limit, and model files carry several
MAX_TOP_LOGPROBS = 20
NDJSON = "application/x-ndjson"
_OLLAMA_PARAMS = {"response_format": "format"}  # the core's names for what Ollama names otherwise, in its errors


def add_routes(app: web.Application) -> None:
    """Register this dialect's routes and error shape."""
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    ollama_models.add_routes(app)
    app[ERROR_SHAPES_KEY].append(("/api/", error_shape))


def error_shape(status: int, message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    """Ollama's error body: the message alone (the HTTP status tells its kind)."""
    return {"error": message}


async def chat(request: web.Request) -> web.StreamResponse:
    began = time.monotonic()
    body = require_object(await read_json(request))
    options = _options(body)
    if body.get("messages") in (None, []):  # Ollama's "load the model" (or, with keep_alive 0, unload) call
        return await _load(request, options, chat=True)
    messages, tools, node = _messages(body["messages"]), _tools(body.get("tools")), request.app[NODE_KEY]
    thinking = _thinking(body)
    started = await _start(lambda capped: start_chat(node, ChatRequest(capped, messages, tools, thinking)), options)
    return await _respond(request, started, Replies(True, options.model, began, started.token_text(options)),
                          options.stream)


async def generate(request: web.Request) -> web.StreamResponse:
    began = time.monotonic()
    body = require_object(await read_json(request))
    options = _options(body)
    for name in ("suffix", "template", "context", "images"):
        if body.get(name) not in (None, "", []):
            raise invalid(f"{name} is not supported by this server", name, "unsupported_parameter")
    prompt, system = text(body, "prompt"), text(body, "system")
    if not prompt:  # Ollama's "load the model" (or, with keep_alive 0, unload) call
        return await _load(request, options, chat=False)
    node = request.app[NODE_KEY]
    if optional_bool(body, "raw"):  # the prompt goes to the model as is
        if system:
            raise invalid("system cannot be combined with raw: a raw prompt is sent as is", "system")
        started = await _start(lambda capped: start_completion(node, CompletionRequest(capped, prompt)), options)
    else:
        turns = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": prompt}]
        thinking = _thinking(body)
        started = await _start(lambda capped: start_chat(node, ChatRequest(capped, turns, None, thinking)), options)
    return await _respond(request, started, Replies(False, options.model, began, started.token_text(options)),
                          options.stream)


async def _start(start: Callable[[GenerationOptions], Awaitable[Started]], options: GenerationOptions) -> Started:
    """Start a generation with `options` (num_predict is a cap in Ollama, never an error: options say so)."""
    with ollama_errors(options.model):
        return await start(options)


@contextlib.contextmanager
def ollama_errors(model: str) -> Iterator[None]:
    """The core's errors in Ollama's words: its "model 'x' not found", its parameter names."""
    try:
        yield
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"model '{model}' not found: {e.message}") from None
    except InvalidRequestError as e:
        renamed = _OLLAMA_PARAMS.get(e.param or "")
        if renamed is None:
            raise
        raise invalid(e.message.replace(e.param or "", renamed), renamed, e.code or "invalid_value") from None


async def _load(request: web.Request, options: GenerationOptions, chat: bool) -> web.Response:
    """Load the model and answer once it is ready (done_reason "load"); with keep_alive 0, unload it ("unload")."""
    node = request.app[NODE_KEY]
    with ollama_errors(options.model):
        if options.keep_alive == 0:
            await node.lifecycle.unload(options.model)
            reason = "unload"
        else:
            await node.lifecycle.load(options.model, options.keep_alive)
            reason = "load"
    empty = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return web.json_response({"model": options.model, "created_at": timestamp(), **empty, "done": True,
                              "done_reason": reason})


# -- requests -----------------------------------------------------------------------------------------------------


def _options(body: dict[str, Any]) -> GenerationOptions:
    """What /api/chat and /api/generate share: model, stream, format, options (vLLM's structured_outputs grammar
    too, as an extension)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required: a non-empty string", "model", "missing_required_parameter")
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise invalid("options must be an object", "options", "invalid_type")
    stream = optional_bool(body, "stream")
    keep_alive = body.get("keep_alive")
    return GenerationOptions(model=model, max_tokens=_num_predict(options), sampling=_sampling(options, body),
                             stop=stop_strings(options.get("stop"), "options.stop", MAX_STOP_STRINGS, one_string=True,
                                               expected="a list of non-empty strings", verb="takes"),
                             stream=True if stream is None else stream,
                             include_usage=False, ignore_eos=False, json_schema=_format(body.get("format")),
                             max_tokens_is_cap=True, grammar=structured_outputs_grammar(body.get("structured_outputs")),
                             keep_alive=None if keep_alive is None else parse_keep_alive(keep_alive))


def _thinking(body: dict[str, Any]) -> Thinking:
    """Ollama's think: true or false, or gpt-oss's level ("low", "medium", "high"); absent, the model's default."""
    think = body.get("think")
    if think is None or isinstance(think, bool):
        return Thinking(think)
    if think in EFFORTS:
        return Thinking(True, effort=think)
    raise invalid(f'think must be true, false or one of {", ".join(EFFORTS)}', "think")


def _sampling(options: dict[str, Any], body: dict[str, Any]) -> SamplingParams:
    top_p = number(options, "top_p", 0.0, 1.0, 0.9)
    repetition = number(options, "repeat_penalty", 0.0, 100.0, 1.0)
    for name, value in (("top_p", top_p), ("repeat_penalty", repetition)):
        if value <= 0.0:
            raise invalid(f"options.{name} must be greater than 0", f"options.{name}")
    seed = integer(options, "seed", -(2**63), 2**64 - 1, -1)
    return SamplingParams(
        temperature=number(options, "temperature", 0.0, 100.0, 0.8), top_p=top_p,
        top_k=integer(options, "top_k", 0, 2**31, 40), min_p=number(options, "min_p", 0.0, 1.0, 0.0),
        seed=None if seed == -1 else seed % 2**64,  # -1: Ollama's "a random seed"
        repetition_penalty=repetition,
        presence_penalty=number(options, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=number(options, "frequency_penalty", -2.0, 2.0, 0.0),
        logprobs=_logprobs(body))


def _num_predict(options: dict[str, Any]) -> int | None:
    """At most this many tokens. -1 (no limit) and -2 (fill the context) both mean as many as the context allows,
    as does 0, which Ollama's runner treats as no limit."""
    count = integer(options, "num_predict", -2, 2**31, -1)
    return count if count > 0 else None


def _logprobs(body: dict[str, Any]) -> int | None:
    """None: no log-probabilities; n: the chosen tokens' and the n likeliest beside each."""
    wanted = optional_bool(body, "logprobs")
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, where="top_logprobs")
    if top and not wanted:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    return top if wanted else None


def _format(value: Any) -> dict[str, Any] | None:
    """Structured output: "json" (any JSON object) or a JSON schema; "" or absent: free text."""
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "object"}
    if not isinstance(value, dict):
        raise invalid('format must be "json" or a JSON schema object', "format")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    """The conversation in the chat-template convention (tool_requests.py)."""
    if not isinstance(value, list):
        raise invalid("messages must be a list", "messages", "invalid_type")
    calls = CallLinker()
    return link_tool_results([_message(m, f"messages[{i}]", calls) for i, m in enumerate(value)])


def _message(value: Any, where: str, calls: CallLinker) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{where} must be an object", where, "invalid_type")
    role = value.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}; got {str(role)[:40]!r}", f"{where}.role")
    if value.get("images"):
        raise invalid(f"{where}.images: images are not supported; this model accepts text only",
                       f"{where}.images", "unsupported_content")
    # An earlier answer's `thinking` is left out, as Ollama leaves it out of templates that do not show it.
    message: dict[str, Any] = {"role": role, "content": text(value, "content", f"{where}.content")}
    if value.get("tool_calls"):
        if role != "assistant":
            raise invalid(f"{where}.tool_calls is only allowed in assistant messages", f"{where}.tool_calls")
        message["tool_calls"] = calls.made(value["tool_calls"], where)
    if role == "tool":
        message["tool_call_id"] = calls.answered(value.get("tool_name"), where)
    return message


@dataclass
class CallLinker:
    """Ollama's tool calls carry no ids: each gets one ("call_<n>") so its result can be linked to it, and a tool
    result answers the first unanswered call of the latest turn that made calls (of its `tool_name`, if given)."""

    made_so_far: int = 0
    unanswered: list[tuple[str, str]] = field(default_factory=list)  # (id, function name)

    def made(self, value: Any, where: str) -> list[dict[str, Any]]:
        if not isinstance(value, list):
            raise invalid(f"{where}.tool_calls must be a list", f"{where}.tool_calls", "invalid_type")
        calls = []
        for i, call in enumerate(value):
            here = f"{where}.tool_calls[{i}].function"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise invalid(f"{here} must be an object with name and arguments", here, "invalid_type")
            calls.append(template_call(f"call_{self.made_so_far}", function.get("name"),
                                       function.get("arguments", {}), here))
            self.made_so_far += 1
        self.unanswered = [(call["id"], call["function"]["name"]) for call in calls]
        return calls

    def answered(self, tool_name: Any, where: str) -> str:
        if tool_name is not None and not isinstance(tool_name, str):
            raise invalid(f"{where}.tool_name must be a string", f"{where}.tool_name", "invalid_type")
        for index, (call_id, name) in enumerate(self.unanswered):
            if not tool_name or name == tool_name:
                del self.unanswered[index]
                return call_id
        wanted = f" of {tool_name!r}" if tool_name else ""
        raise invalid(f"{where} is a tool result, but no unanswered tool call{wanted} precedes it: a tool message "
                       "answers a call of an earlier assistant message", f"{where}.tool_name")


def _tools(value: Any) -> ToolUse | None:
    """The offered tools; the model decides whether to call them (Ollama has no tool_choice)."""
    if value in (None, []):
        return None
    if not isinstance(value, list):
        raise invalid("tools must be a list of function tools", "tools", "invalid_type")
    return ToolUse(unique_tools([_tool(tool, f"tools[{i}]") for i, tool in enumerate(value)], "tools"))


def _tool(value: Any, where: str) -> Tool:
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict) or value.get("type", "function") != "function":
        raise invalid(f'{where} must be {{"type": "function", "function": {{...}}}}', where, "invalid_type")
    return check_tool(function.get("name"), function.get("description"), function.get("parameters"),
                      f"{where}.function")


# -- responses ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replies:
    """Builds one request's response objects: /api/chat's (a `message`) or /api/generate's (a `response`)."""

    chat: bool
    model: str  # as the client named it: clients match replies to their models by name
    began: float  # time.monotonic() when the request arrived
    token_text: Callable[[int], str] | None = None  # set when the request asked for log-probabilities

    def lines(self, piece: Piece) -> list[dict[str, Any]]:
        """A piece's lines: its reasoning, its text, then its tool calls (Ollama streams each call whole)."""
        with_text = piece.text or (piece.tokens and self.token_text is not None)
        shown = [self._line("", thinking=piece.reasoning)] if piece.reasoning else []
        shown += [self._line(piece.text, tokens=piece.tokens)] if with_text else []
        return shown + ([self._line("", piece.calls)] if piece.calls else [])

    def whole(self, piece: Piece, generation: TextGeneration) -> dict[str, Any]:
        return {**self._line(piece.text, piece.calls, piece.tokens, piece.reasoning), **self._done(generation)}

    def final(self, generation: TextGeneration) -> dict[str, Any]:
        return {**self._line(""), **self._done(generation)}

    def _line(self, content: str, calls: tuple[ToolCall, ...] = (), tokens: tuple[Choice, ...] = (),
              thinking: str = "") -> dict[str, Any]:
        """A line of the reply; a reasoning model's reasoning in `thinking` (Ollama's field: the message's in a
        chat, the line's in a generate)."""
        shown: dict[str, Any] = {"response": content, **({"thinking": thinking} if thinking else {})}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content,
                                       **({"thinking": thinking} if thinking else {})}
            if calls:  # arguments as an object, where OpenAI's are JSON text
                message["tool_calls"] = [{"function": {"name": call.name, "arguments": json.loads(call.arguments)}}
                                         for call in calls]
            shown = {"message": message}
        line = {"model": self.model, "created_at": timestamp(), **shown, "done": False}
        if self.token_text is not None and tokens:
            line["logprobs"] = [{**self._entry(t.token, t.logprob),
                                 "top_logprobs": [self._entry(token, logprob) for token, logprob in t.top_logprobs]}
                                for t in tokens]
        return line

    def _entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        assert self.token_text is not None
        shown = self.token_text(token)
        return {"token": shown, "logprob": logprob, "bytes": list(shown.encode("utf-8"))}

    def _done(self, generation: TextGeneration) -> dict[str, Any]:
        """Why it ended (Ollama knows no "tool_calls": a turn that called tools stopped), counts and durations."""
        now = time.monotonic()
        first, last = (generation.token_times[0], generation.token_times[-1]) if generation.token_times else (now, now)
        return {"done": True, "done_reason": "length" if generation.finish_reason == "length" else "stop",
                "total_duration": _ns(now - self.began), "load_duration": _ns(generation.started - self.began),
                "prompt_eval_count": len(generation.prompt_tokens),
                "prompt_eval_duration": _ns(first - generation.started),
                "eval_count": generation.completion_tokens, "eval_duration": _ns(last - first)}


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


async def _respond(request: web.Request, started: Started, replies: Replies, stream: bool) -> web.StreamResponse:
    choices = started.choices
    async with generating(request, choices, f"ollama-{choices.request_id}"):
        if stream:
            return await _stream(request, choices, replies)
        whole = (await choices.wholes())[0]
        record(request.app[NODE_KEY], choices)
        return web.json_response(replies.whole(whole, choices.generations[0]))


async def _stream(request: web.Request, choices: ChoiceSet, replies: Replies) -> web.StreamResponse:
    """NDJSON: a line per piece, then the final line with the counts; an error after the status line is a line."""
    return await stream_out(request, choices, f"ollama-{choices.request_id}", _lines(request, choices, replies),
                            ndjson, error_shape, content_type=NDJSON)


async def _lines(request: web.Request, choices: ChoiceSet, replies: Replies) -> AsyncIterator[dict[str, Any]]:
    async with contextlib.aclosing(choices.pieces()) as pieces:
        async for _, piece in pieces:
            if piece is None:
                record(request.app[NODE_KEY], choices)  # before the last line: a client that scrapes /metrics next
                yield replies.final(choices.generations[0])  # sees it
                continue
            for line in replies.lines(piece):
                yield line
