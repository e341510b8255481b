"""Parsing and validation of the OpenAI chat and completions bodies, into the dialect-neutral request
(requests.py) the one core runs; Responses (responses_api.py) builds its options from the same chat fields.

Every problem with a request becomes an InvalidRequestError naming the offending parameter, so bad input is
always a 400 with an OpenAI error body, never a 500. Unknown fields are ignored (clients send `user`,
`metadata`, ...), but known features this server does not implement are rejected unless they carry their
neutral value (e.g. presence_penalty=0), so a client never silently gets something other than it asked for.
Extensions, spelled as in vLLM: `top_k`, `min_p`, `repetition_penalty`, `return_tokens_as_token_ids`, and
`ignore_eos` (generate exactly max_tokens; for benchmarks).
"""

from __future__ import annotations

from typing import Any

from exo_like.api.reasoning import Thinking
from exo_like.api.requests import (EFFORTS, MAX_STOP_STRINGS, ChatRequest, CompletionRequest, GenerationOptions,
                                   checked_text, is_int, model_name, optional_bool, optional_float, optional_int,
                                   require_object, stop_strings, structured_outputs_grammar, text_content)
from exo_like.api.tool_requests import link_tool_results, openai_tool_calls, openai_tool_use
from exo_like.errors import InvalidRequestError
from exo_like.serving.sampling import SamplingParams

MAX_N = 16  # choices a request may ask for
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit; the same for completions' logprobs, as vLLM allows)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint

# Known but unimplemented parameters, and the values that ask for nothing (so they are safe to accept).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "modalities": (None, ["text"]),
    "audio": (None,),
}


def parse_chat_request(body: Any) -> ChatRequest:
    body = require_object(body)
    max_tokens = optional_int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = optional_int(body, "max_tokens", minimum=1)
    return ChatRequest(_options(body, max_tokens, chat=True), _messages(body.get("messages")), openai_tool_use(body),
                       openai_thinking(body))


def openai_thinking(body: dict[str, Any]) -> Thinking:
    """The reasoning switches of an OpenAI chat request, as vLLM and llama.cpp take them: chat_template_kwargs'
    enable_thinking (Qwen3) or thinking (DeepSeek V3.1), and reasoning_effort ("none" turns it off; "minimal"
    is "low", the least gpt-oss knows)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object", param="chat_template_kwargs",
                                  code="invalid_type")
    enabled = None
    for key in ("enable_thinking", "thinking"):
        if kwargs and key in kwargs:
            enabled = optional_bool(kwargs, key, f"chat_template_kwargs.{key}")
    effort = body.get("reasoning_effort")
    if effort is None:
        return Thinking(enabled)
    if effort not in ("none", "minimal", *EFFORTS):
        raise InvalidRequestError(f"reasoning_effort must be one of none, minimal, {', '.join(EFFORTS)}",
                                  param="reasoning_effort", code="invalid_value")
    if effort == "none":
        return Thinking(False)
    return Thinking(enabled, effort="low" if effort == "minimal" else effort)


def parse_completion_request(body: Any) -> CompletionRequest:
    body = require_object(body)
    max_tokens = optional_int(body, "max_tokens", minimum=1)
    options = _options(body, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, chat=False)
    return CompletionRequest(options, _prompt(body.get("prompt")))


def _options(body: dict[str, Any], max_tokens: int | None, chat: bool) -> GenerationOptions:
    _reject_unsupported(body)
    n = optional_int(body, "n", minimum=1, maximum=MAX_N)
    stream = optional_bool(body, "stream") or False
    return GenerationOptions(
        model=model_name(body),
        max_tokens=max_tokens,
        sampling=_sampling(body, chat),
        stop=stop_strings(body.get("stop"), "stop", MAX_STOP_STRINGS, one_string=True,
                          expected="a string or a list of strings", empty_apart=True),
        stream=stream,
        include_usage=_include_usage(body, stream),
        ignore_eos=optional_bool(body, "ignore_eos") or False,
        tokens_as_ids=optional_bool(body, "return_tokens_as_token_ids") or False,
        n=n or 1,
        json_schema=_response_format(body.get("response_format")),
        grammar=structured_outputs_grammar(body.get("structured_outputs")),
    )


def _sampling(body: dict[str, Any], chat: bool) -> SamplingParams:
    temperature = optional_float(body, "temperature", 0.0, 2.0)
    top_p = optional_float(body, "top_p", 0.0, 1.0)
    if top_p is not None and top_p <= 0.0:
        raise InvalidRequestError("top_p must be greater than 0 and at most 1", param="top_p", code="invalid_value")
    top_k = optional_int(body, "top_k", minimum=0)
    seed = optional_int(body, "seed", minimum=-(2**63), maximum=2**64 - 1)
    repetition = optional_float(body, "repetition_penalty", 0.0, 100.0)
    if repetition is not None and repetition <= 0.0:
        raise InvalidRequestError("repetition_penalty must be greater than 0", param="repetition_penalty",
                                  code="invalid_value")
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or 0,
        # numpy seeds must be non-negative; map OpenAI's signed 64-bit seeds onto them one to one.
        seed=None if seed is None else seed % 2**64,
        min_p=optional_float(body, "min_p", 0.0, 1.0) or 0.0,
        presence_penalty=optional_float(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=optional_float(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        repetition_penalty=1.0 if repetition is None else repetition,
        logit_bias=_logit_bias(body.get("logit_bias")),
        logprobs=_chat_logprobs(body) if chat else optional_int(body, "logprobs", 0, MAX_TOP_LOGPROBS),
    )


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format: text (nothing to enforce), json_object (any JSON object) or json_schema (JSON its
    schema accepts; enforced whether or not `strict` is set, as vLLM does). The schema itself is checked when the
    grammar is built (chat.structured)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format must be an object", param="response_format", code="invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type must be one of text, json_object, json_schema; got "
                                  f"{str(kind)[:40]!r}", param="response_format.type", code="invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object with the schema's name and schema",
                                  param="response_format.json_schema", code="invalid_type")
    name = spec.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise InvalidRequestError("response_format.json_schema.name must be a string of 1 to 64 characters",
                                  param="response_format.json_schema.name", code="invalid_value")
    optional_bool(spec, "strict", param="response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object",
                                  param="response_format.json_schema.schema", code="invalid_type")
    return schema


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to biases in [-100, 100]; the ids are checked against the model's
    vocabulary once it is known (generation.check_token_ids)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequestError("logit_bias must be an object mapping token ids to biases", param="logit_bias",
                                  code="invalid_type")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(value)}",
                                  param="logit_bias", code="invalid_value")
    pairs = []
    for key, bias in value.items():
        if not key.isascii() or not key.isdigit() or len(key) > 10:  # (int() refuses thousands of digits)
            raise InvalidRequestError(f"logit_bias keys must be token ids; got {key[:40]!r}", param="logit_bias",
                                      code="invalid_value")
        pairs.append((int(key), optional_float({"logit_bias": bias}, "logit_bias", -100.0, 100.0)))
    if any(bias is None for _, bias in pairs):
        raise InvalidRequestError("logit_bias values must be numbers between -100 and 100", param="logit_bias",
                                  code="invalid_type")
    return tuple(pairs)  # type: ignore[arg-type]


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat: `logprobs` (a boolean) asks for the chosen tokens' log-probabilities, `top_logprobs` for that many
    likeliest tokens' beside them (only with logprobs)."""
    wanted = optional_bool(body, "logprobs")
    top = optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs",
                                  code="invalid_value")
    return (top or 0) if wanted else None


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options must be an object", param="stream_options", code="invalid_type")
    if not stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options",
                                  code="invalid_value")
    return optional_bool(options, "include_usage", param="stream_options.include_usage") or False


def _reject_unsupported(body: dict[str, Any]) -> None:
    for name, neutral in _NEUTRAL_VALUES.items():
        value = body.get(name)
        # `value in neutral` alone would accept True for 1 and 0.0 for False: compare types as well.
        if not any(value == ok and type(value) is type(ok) for ok in neutral):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise InvalidRequestError(f"{name}={shown} is not supported by this server",
                                      param=name, code="unsupported_parameter")


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise InvalidRequestError("messages is required", param="messages", code="missing_required_parameter")
    if not isinstance(value, list):
        raise InvalidRequestError("messages must be a list", param="messages", code="invalid_type")
    if not value:
        raise InvalidRequestError("messages must contain at least one message", param="messages",
                                  code="invalid_value")
    return link_tool_results([_message(m, f"messages[{i}]") for i, m in enumerate(value)])


def _message(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be an object", param=where, code="invalid_type")
    role = value.get("role")
    if role == "function":
        raise InvalidRequestError(f"{where}: role 'function' (the deprecated function calling) is not supported; "
                                  "use tools and role 'tool'", param=f"{where}.role", code="unsupported_parameter")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                                  param=f"{where}.role", code="invalid_value")
    calls = value.get("tool_calls")
    if calls is not None and role != "assistant":
        raise InvalidRequestError(f"{where}.tool_calls is only allowed in assistant messages",
                                  param=f"{where}.tool_calls", code="invalid_value")
    # `developer` is OpenAI's newer name for `system`; chat templates only know the latter. An assistant message
    # that only calls tools has no content: templates get "" (some trim it).
    empty_ok = role == "assistant" and calls is not None
    message: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": "" if empty_ok and value.get("content") is None
                               else text_content(value.get("content"), f"{where}.content")}
    if calls is not None:
        message["tool_calls"] = openai_tool_calls(calls, where)
    if role == "tool":
        call_id = value.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{where}.tool_call_id is required: the id of the call this result answers",
                                      param=f"{where}.tool_call_id", code="missing_required_parameter")
        message["tool_call_id"] = call_id
    name = value.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidRequestError(f"{where}.name must be a string", param=f"{where}.name", code="invalid_type")
        message["name"] = checked_text(name, f"{where}.name")
    return message


def _prompt(value: Any) -> str | list[int]:
    """A string, a list of one string, a list of token ids, or a list of one list of token ids."""
    if value is None:
        raise InvalidRequestError("prompt is required", param="prompt", code="missing_required_parameter")
    if isinstance(value, str):
        return checked_text(value, "prompt")
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("prompt must be a string, a list of one string, or a non-empty list of token "
                                  "ids", param="prompt", code="invalid_type")
    if all(is_int(v) for v in value):
        return list(value)
    if len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise InvalidRequestError("batched prompts are not supported; send one prompt per request",
                                  param="prompt", code="unsupported_parameter")
    if len(value) == 1 and isinstance(value[0], str):
        return checked_text(value[0], "prompt")
    if len(value) == 1 and isinstance(value[0], list) and value[0] and all(is_int(v) for v in value[0]):
        return list(value[0])
    raise InvalidRequestError("prompt must be a string, a list of one string, or a non-empty list of token ids",
                              param="prompt", code="invalid_type")
