"""Validation of request fields every dialect shares: each problem becomes an InvalidRequestError naming the field
(a 400 in the dialect's own error shape), never a 500."""

from __future__ import annotations

import math
from typing import Any

from exo_like.errors import InvalidRequestError


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
