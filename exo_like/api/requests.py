"""The dialect-neutral request every dialect's body becomes (a ChatRequest or a CompletionRequest, with its
GenerationOptions), and the validation of the fields the dialects share: each problem becomes an InvalidRequestError
naming the field (a 400 in the dialect's own error shape), never a 500."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from exo_like.api.reasoning import Thinking
from exo_like.api.tool_requests import ToolUse
from exo_like.errors import InvalidRequestError
from exo_like.serving.sampling import SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit, which Anthropic's dialect takes too (Ollama's sets its own)
EFFORTS = ("low", "medium", "high")  # reasoning efforts, as gpt-oss knows them


@dataclass(frozen=True)
class GenerationOptions:
    """What every request shares. max_tokens None means: as many as the context allows."""

    model: str
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: log-probabilities name tokens "token_id:N"
    n: int = 1  # choices: generations of the one prompt
    json_schema: dict[str, Any] | None = None  # structured output: the text is JSON this schema accepts
    # max_tokens past the context's end means "to the end" (Anthropic's and Ollama's clients ask for more than small
    # models hold: Claude Code sends 32000), not a 400 as in OpenAI's dialect
    max_tokens_is_cap: bool = False
    keep_alive: float | None = None  # seconds its model stays loaded after it (Ollama's keep_alive; None: --keep-alive)
    grammar: str | None = None  # vLLM's structured_outputs.grammar: a Lark grammar (llguidance's) the text must match


@dataclass(frozen=True)
class ChatRequest:
    options: GenerationOptions
    messages: list[dict[str, Any]]  # in the chat-template convention (tool_requests.py)
    tool_use: ToolUse | None = None
    thinking: Thinking = Thinking()  # a reasoning model's switches, in the dialect's words


@dataclass(frozen=True)
class CompletionRequest:
    options: GenerationOptions
    prompt: str | list[int]


def structured_outputs_grammar(value: Any) -> str | None:
    """vLLM's structured_outputs with a grammar: {"grammar": "<Lark grammar>"} (llguidance's Lark dialect); taken
    by the other dialects too, as an extension."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"grammar"} or not isinstance(value["grammar"], str):
        raise InvalidRequestError('structured_outputs must be {"grammar": "<a Lark grammar>"}',
                                  param="structured_outputs", code="invalid_value")
    return value["grammar"]


def stop_strings(value: Any, param: str, limit: int, *, one_string: bool, expected: str, empty_apart: bool = False,
                 verb: str = "accepts") -> tuple[str, ...]:
    """A request's stop strings (none when absent): a list of at most `limit` non-empty strings, or with
    `one_string` a single string as well. What the dialects differ in: `param` names the field; `expected` ends
    the type error ("{param} must be {expected}"), `verb` the count's ("{param} {verb} at most ..."); an empty
    string fails the type check, or with `empty_apart` an error of its own after the count (OpenAI's)."""
    if value is None:
        return ()
    stops = [value] if one_string and isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and (s or empty_apart) for s in stops):
        raise InvalidRequestError(f"{param} must be {expected}", param=param, code="invalid_type")
    if len(stops) > limit:
        raise InvalidRequestError(f"{param} {verb} at most {limit} strings, got {len(stops)}", param=param,
                                  code="invalid_value")
    if "" in stops:
        raise InvalidRequestError(f"{param} strings must not be empty", param=param, code="invalid_value")
    return tuple(stops)


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, not {json_type(body)}")
    return body


def model_name(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise InvalidRequestError("you must provide a model parameter", param="model",
                                  code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("model must be a non-empty string", param="model", code="invalid_type")
    return model


def checked_text(text: str, param: str) -> str:
    """Text that goes into the prompt. JSON's "\\ud800" escape decodes to a lone surrogate, which is no Unicode
    character: the tokenizer cannot take it, so it is the client's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{param} is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                                  f"{e.start}", param=param, code="invalid_value") from None
    return text


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not the number 1


def optional_int(body: dict[str, Any], name: str, minimum: int | None = None,
                  maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise InvalidRequestError(f"{name} must be an integer, not {json_type(value)}", param=name,
                                  code="invalid_type")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise InvalidRequestError(f"{name} must be {_range_text(minimum, maximum)}; got {value}", param=name,
                                  code="invalid_value")
    return value


def optional_float(body: dict[str, Any], name: str, minimum: float, maximum: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, not {json_type(value)}", param=name,
                                  code="invalid_type")
    if not math.isfinite(value) or not minimum <= value <= maximum:
        raise InvalidRequestError(f"{name} must be between {minimum:g} and {maximum:g}; got {value}", param=name,
                                  code="invalid_value")
    return float(value)


def optional_bool(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise InvalidRequestError(f"{param or name} must be a boolean, not {json_type(value)}", param=param or name,
                              code="invalid_type")


def _range_text(minimum: int | None, maximum: int | None) -> str:
    if maximum is None:
        return f"at least {minimum}"
    return f"between {minimum} and {maximum}"


def json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def text_content(content: Any, param: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """Message text: a string, or a list of text parts (of `part_types`) joined with newlines, as vLLM joins them;
    any other part (an image, a file) is refused: the models served take text only."""
    if isinstance(content, str):
        return checked_text(content, param)
    if content is None:
        raise InvalidRequestError(f"{param} is required", param=param, code="missing_required_parameter")
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param} must be a string or a list of content parts", param=param,
                                  code="invalid_type")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise InvalidRequestError(f"{param}[{i}] must be an object", param=f"{param}[{i}]", code="invalid_type")
        kind = part.get("type")
        if kind not in part_types:
            raise InvalidRequestError(f"{param}[{i}]: content part type {str(kind)[:40]!r} is not supported; this "
                                      "model accepts text only", param=f"{param}[{i}].type",
                                      code="unsupported_content")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{param}[{i}].text must be a string", param=f"{param}[{i}].text",
                                      code="invalid_type")
        texts.append(checked_text(part["text"], f"{param}[{i}].text"))
    return "\n".join(texts)
