"""Constrained decoding: a grammar (llguidance) decides which tokens a request may sample next.

Structured output (`response_format` json_schema / json_object) and forced tool calls (`tool_choice` required or a
named function) are grammars. The node that takes the request checks its grammar against the model's vocabulary
(a bad schema is the client's 400); the last stage, which samples, keeps one matcher per constrained request,
rebuilt from the request's tokens when the request arrives (first token, after a preemption, on a new ring) and
advanced by every token it samples. The mask is applied in the sampler (serving/sampling.py) before anything else.

llguidance was chosen over xgrammar by measurement on these machines (a batch of 8 JSON schemas): compile 1.6-2.9 ms
against 11-924 ms, masks 0.4 ms per request, +7 MB installed against 1.3 GB, and both covered 200/200 schemas.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from exo_like.models.names.resolver import LoadedModel

log = logging.getLogger(__name__)

# Compact JSON (no whitespace between tokens): a model free to add whitespace can pad forever and never close the
# object.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar (or the schema it came from) that cannot be compiled for this model."""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text matching `schema` (checked by GrammarVocabulary.check)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(str(e)) from None


class GrammarVocabulary:
    """A model's tokens as the grammar engine sees them. Building it reads the whole vocabulary (about a second for
    150k tokens), so a node makes one per model and keeps it."""

    def __init__(self, tokenizer_json: str, tokenizer_size: int, logits_size: int, eos_ids: Sequence[int]):
        self.logits_size = logits_size
        self.eos_ids = tuple(eos_ids)
        # The mask covers the larger of the two: logits past the tokenizer's tokens (padding) are never allowed.
        self.size = max(tokenizer_size, logits_size)
        # (No eos id known: llguidance takes the tokenizer's own end-of-sequence token.)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.size, eos_token=list(self.eos_ids) or None)
        self.eos_ids = self.eos_ids or tuple(self.tokenizer.eos_tokens)

    def check(self, grammar: str) -> None:
        """Raise GrammarError naming what is wrong when `grammar` cannot be matched with this vocabulary."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(messages[0])

    def constraint(self, grammar: str, generated: Sequence[int] = ()) -> "Constraint":
        return Constraint(self, grammar, generated)


class Constraint:
    """One request's grammar, advanced through the tokens it has generated so far."""

    def __init__(self, vocabulary: GrammarVocabulary, grammar: str, generated: Sequence[int] = ()):
        self.vocabulary = vocabulary
        self.matcher = llguidance.LLMatcher(vocabulary.tokenizer, grammar, log_level=0)
        self._bits = llg_numpy.allocate_token_bitmask(1, vocabulary.size)
        if generated and not self.matcher.consume_tokens(list(generated)):
            log.warning("grammar rejected a request's own tokens on rebuild: %s", self.matcher.get_error())

    def allowed(self) -> np.ndarray:
        """Which logits may be sampled next (bool, one per logit). Once the grammar is complete only the end of
        sequence is; a matcher in error (limits exceeded) allows only that too, so the request ends."""
        llg_numpy.fill_next_token_bitmask(self.matcher, self._bits, 0)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocabulary.logits_size]
        allowed = allowed.astype(bool)
        if not allowed.any():
            allowed[list(self.vocabulary.eos_ids)] = True
        return allowed

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            log.warning("grammar rejected token %d: %s", token, self.matcher.get_error())

    @property
    def finished(self) -> bool:
        """The grammar's text is complete: nothing but the end of sequence may follow."""
        return self.matcher.is_stopped()


class GrammarVocabularies:
    """Each served model's vocabulary for the grammar engine, built on first use and kept while the model is among
    the last few used (the API's checks and the last stage's sampling, on the engine thread, may ask at once)."""

    KEPT = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built: dict[str, GrammarVocabulary] = {}  # by model key, least recently used first

    def get(self, model: LoadedModel) -> GrammarVocabulary:
        with self._lock:
            vocabulary = self._built.pop(model.key, None)
            if vocabulary is None:
                tokenizer = model.tokenizer
                vocabulary = GrammarVocabulary(tokenizer.tokenizer.to_str(), tokenizer.vocab_size,
                                               model.args.vocab_size, model.args.eos_token_ids)
            self._built[model.key] = vocabulary
            while len(self._built) > self.KEPT:
                self._built.pop(next(iter(self._built)))
            return vocabulary
