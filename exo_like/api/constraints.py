"""The grammar a request's output must match: its structured-output schema (or, later in the request's life, a
forced tool call), checked against the served model's vocabulary before any work starts so that a schema the
engine cannot enforce is the client's 400, not a failure mid-stream."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from exo_like.api.openai_requests import GenerationOptions
from exo_like.cluster.protocol import MAX_GRAMMAR
from exo_like.errors import InvalidRequestError
from exo_like.node import LoadedModel, Node
from exo_like.serving.grammar import GrammarError, json_schema_grammar


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
