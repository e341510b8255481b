"""The one core every dialect drives: from an internal request (a ChatRequest or a CompletionRequest, whichever
dialect parsed it) to the running generations of its choices.

A chat request is rendered through the model's own chat template (with its tools; a template that cannot show
them gets them in the generic format's system message), its output constrained by a grammar when it asks for
structured output or forces a tool call (and for tool_choice auto in the generic format; checked against the
model's vocabulary before any work starts), and read back for tool calls in the model's format. The dialects
(OpenAI chat and completions, Responses, Anthropic, Ollama) only translate shapes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from exo_like.api.choices import ChoiceSet
from exo_like.api.generation import (ReasoningPlan, TextGeneration, check_token_ids, completion_prompt_tokens,
                                     resolve_max_tokens)
from exo_like.api.reasoning import ReasoningFormat, Thinking
from exo_like.api.reasoning.detect import detect as detect_reasoning
from exo_like.api.reasoning.harmony import FINAL as HARMONY_FINAL, HARMONY
from exo_like.api.reasoning.think import CLOSE as THINK_CLOSE, OPEN as THINK_OPEN, THINK
from exo_like.api.requests import ChatRequest, CompletionRequest, GenerationOptions
from exo_like.api.tool_calls import ToolFormat, generic, harmony
from exo_like.api.tool_calls.detect import detect
from exo_like.api.tool_requests import ToolUse
from exo_like.cluster.protocol import MAX_GRAMMAR
from exo_like.errors import InvalidRequestError
from exo_like.node import LoadedModel, Node
from exo_like.serving.generation import TokenGenerator
from exo_like.serving.grammar import GrammarError, json_schema_grammar


@dataclass(frozen=True)
class Started:
    """A request's model and the generations of its choices."""

    model: LoadedModel
    choices: ChoiceSet

    def token_text(self, options: GenerationOptions) -> Callable[[int], str] | None:
        """How a token is shown beside its log-probability (each alone, as vLLM does), when they are asked for."""
        if options.sampling.logprobs is None:
            return None
        if options.tokens_as_ids:
            return lambda token: f"token_id:{token}"
        return lambda token: self.model.tokenizer.decode([token], skip_special_tokens=False)


async def start_chat(node: Node, request: ChatRequest, tools_param: str = "tools",
                     choice_param: str = "tool_choice") -> Started:
    """Render, constrain and start a chat request; the params name the dialect's fields in errors."""
    model, generator = await node.lifecycle.require(request.options.model, request.options.keep_alive,
                                                request.options.stream)
    use = request.tool_use
    tool_format = _tool_format(model, use)
    reasoning_format = detect_reasoning(model.args.model_type, model.tokenizer.chat_template_source)
    messages, tools = _rendered(request.messages, use, tool_format)
    text = model.tokenizer.render_chat(messages, tools=tools, switches=_switches(request.thinking))
    text, reasoning = _reasoning(model, reasoning_format, text, request.thinking)
    prompt = model.tokenizer.encode(text, add_special_tokens=False)
    options = await structured(node, model, request.options)
    grammar = _tool_grammar(model, use, tool_format, options.sampling.grammar is not None, choice_param)
    options = await with_grammar(node, model, options, grammar, tools_param)
    parsed_format = tool_format if use is not None and use.parses else None
    if parsed_format is None and reasoning_format is HARMONY:
        parsed_format = harmony.HARMONY  # its answer is read out of the final channel, calls or not
    return _start(model, generator, prompt, options, "messages", parsed_format, use, reasoning)


async def start_completion(node: Node, request: CompletionRequest) -> Started:
    model, generator = await node.lifecycle.require(request.options.model, request.options.keep_alive,
                                                request.options.stream)
    prompt = completion_prompt_tokens(model.tokenizer, request.prompt)
    return _start(model, generator, prompt, await structured(node, model, request.options), "prompt",
                  None)


def _switches(thinking: Thinking) -> dict[str, Any]:
    """The template variables a request's reasoning switches set (templates that know none of them ignore them)."""
    switches: dict[str, Any] = {}
    if thinking.enabled is not None:
        switches["enable_thinking"] = switches["thinking"] = thinking.enabled
    if thinking.effort is not None:
        switches["reasoning_effort"] = thinking.effort
    return switches


def _reasoning(model: LoadedModel, found: ReasoningFormat | None, prompt: str,
               thinking: Thinking) -> tuple[str, ReasoningPlan | None]:
    """The prompt as generation continues it, and how its output is read for reasoning (None: the model does not
    reason). Thinking off (or a budget of 0) on a template that does not turn it off itself: the prompt gets an
    empty reasoning block, closed, so the answer begins at once."""
    if found is None:
        return prompt, None
    if thinking.enabled is False or thinking.budget == 0:
        prompt = _without_reasoning(found, prompt)
    tokenizer = model.tokenizer
    close = tuple(tokenizer.encode(found.close, add_special_tokens=False))
    return prompt, ReasoningPlan(found, found.opened(prompt), thinking.budget, close,
                                 bool(tokenizer.special_token_ids(found.markers)))


def _without_reasoning(found: ReasoningFormat, prompt: str) -> str:
    if found.opened(prompt):
        return prompt + found.close
    if found is THINK and not prompt.rstrip().endswith(THINK_CLOSE):
        return prompt + THINK_OPEN + found.close  # the model would open it itself
    if found is HARMONY:
        return prompt + HARMONY_FINAL  # straight to the final channel
    return prompt


def _tool_format(model: LoadedModel, use: ToolUse | None) -> ToolFormat | None:
    """The model's own tool format, or the generic one where its template cannot show tools."""
    if use is None or not use.tools:
        return None
    return detect(model.args.model_type, model.tokenizer.chat_template_source) or generic.GENERIC


def _rendered(messages: list[dict[str, Any]], use: ToolUse | None,
              tool_format: ToolFormat | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools the template gets. A template that cannot show tools gets them in a system message
    (not with tool_choice none: the model is then not to call any), and the conversation's calls and results as
    text."""
    if tool_format is not generic.GENERIC:
        return messages, use.as_template_tools() if use else None
    assert use is not None
    return generic.prompt_messages(messages, use.tools if use.parses else (), not use.single), None


def _tool_grammar(model: LoadedModel, use: ToolUse | None, tool_format: ToolFormat | None, formatted: bool,
                  choice_param: str) -> str | None:
    """The grammar tool use puts on the output (`formatted`: a response format holds it already): a forced
    call's, or the format's grammar for auto (the response format's instead, when there is one)."""
    if use is None or tool_format is None or not use.parses or (formatted and not use.forced):
        return None
    if formatted:
        raise InvalidRequestError(f"{choice_param} forces a tool call, which cannot be combined with a "
                                  "response format", param=choice_param, code="invalid_value")
    special = model.tokenizer.special_token_ids(tool_format.markers)
    if use.forced:
        return tool_format.forced_grammar(use.tools, use.name, not use.single, special=special)
    return tool_format.auto_grammar(use.tools, not use.single, special=special)


def _start(model: LoadedModel, generator: TokenGenerator, prompt: list[int], options: GenerationOptions,
           prompt_param: str, tool_format: ToolFormat | None, use: ToolUse | None = None,
           reasoning: ReasoningPlan | None = None) -> Started:
    """The request's n generations. With a seed, choice i samples with seed + i (reproducible, and the choices
    differ); without, each draws its own."""
    check_token_ids(min(model.tokenizer.vocab_size, model.args.vocab_size), options)
    max_tokens = resolve_max_tokens(len(prompt), options.max_tokens, model.args.context_length, prompt_param,
                                    options.max_tokens_is_cap)
    seed = options.sampling.seed
    one_call, named_call = (use.single, use.choice == "function") if use is not None else (False, False)
    return Started(model, ChoiceSet([
        TextGeneration(generator, model.tokenizer, prompt,
                       options if i == 0 or seed is None else
                       replace(options, sampling=replace(options.sampling, seed=(seed + i) % 2**64)),
                       max_tokens, model.args.eos_token_ids, tool_format=tool_format,
                       one_call=one_call, named_call=named_call, reasoning=reasoning)
        for i in range(options.n)]))


# -- the grammar a request's output must match: its structured-output schema (or a forced tool call), checked
# against the served model's vocabulary before any work starts, so that a schema the engine cannot enforce is the
# client's 400, not a failure mid-stream.


async def with_grammar(node: Node, model: LoadedModel, options: GenerationOptions, grammar: str | None,
                       param: str) -> GenerationOptions:
    """`options` sampling under `grammar` (checked against `model`'s tokens; `param` names what it came from in
    errors)."""
    if grammar is None:
        return options
    if len(grammar) > MAX_GRAMMAR:
        raise InvalidRequestError(f"{param} is too large to enforce: its grammar has {len(grammar)} characters, at "
                                  f"most {MAX_GRAMMAR}", param=param, code="invalid_value")
    vocabulary = await asyncio.to_thread(node.grammars.get, model)
    try:
        await asyncio.to_thread(vocabulary.check, grammar)
    except GrammarError as e:
        raise InvalidRequestError(f"{param} cannot be enforced: {e}", param=param, code="invalid_schema") from None
    return replace(options, sampling=replace(options.sampling, grammar=grammar))


async def structured(node: Node, model: LoadedModel, options: GenerationOptions) -> GenerationOptions:
    """`options` with its response format's schema, or its grammar, enforced (unchanged without either)."""
    if options.grammar is not None:
        if options.json_schema is not None:
            raise InvalidRequestError("structured_outputs and response_format cannot be combined",
                                      param="structured_outputs", code="invalid_value")
        return await with_grammar(node, model, options, options.grammar, "structured_outputs")
    if options.json_schema is None:
        return options
    try:
        grammar = json_schema_grammar(options.json_schema)
    except GrammarError as e:
        raise InvalidRequestError(f"response_format's schema is not valid: {e}", param="response_format",
                                  code="invalid_schema") from None
    return await with_grammar(node, model, options, grammar, "response_format")
